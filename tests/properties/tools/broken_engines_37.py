"""Engines and adapters for ``test_broken_inputs_37.py`` (issue 37: robust gate, round three;
test fixtures, not part of the package).

* :func:`make_forks`: the reference engine that starts a helper process (``sleep``) each
  time it is built, as an engine with a server or a compile helper would; the helpers'
  pids are appended to the file ``KVCONFORM_TEST_PIDS`` names.
* :func:`make_miscounts_at_scale`: one free block too few once any is in use, but only on
  a pool of at least 256 blocks (the medium tier's smallest): a bug only a large tier
  finds.
* :func:`make_burns_cpu_once`: correct, but its first ``new_step`` burns
  ``KVCONFORM_TEST_BURN_S`` seconds of its own CPU time (a slow engine, not a hung one).
* :func:`make_full_only`: the reference engine declaring full attention only.
* ``ENGINE_WITH_STRATEGY``: an engine with a ``layout_strategy`` (one layout is drawn
  from it when it is loaded, as SGLang's adapter does) that miscounts its free blocks.
"""

from __future__ import annotations

import os
import subprocess
import time

from hypothesis import strategies as st

from properties.engines.reference import ReferenceEngine
from properties.engines.under_test import EngineUnderTest
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec
from tests.properties.tools.broken_engines import Broken

PIDS_ENV = "KVCONFORM_TEST_PIDS"
BURN_ENV = "KVCONFORM_TEST_BURN_S"


def make_forks(layout: KVCacheLayout) -> ReferenceEngine:
    helper = subprocess.Popen(["sleep", "600"])
    with open(os.environ[PIDS_ENV], "a", encoding="utf-8") as out:
        out.write(f"{helper.pid}\n")
    return ReferenceEngine(layout)


def make_miscounts_at_scale(layout: KVCacheLayout) -> Broken:
    def rewrite(answer, engine):
        if layout.num_blocks >= 256 and 0 < answer < layout.num_blocks - 1:
            return answer - 1
        return answer

    return Broken(layout, "num_free_blocks", rewrite)


class BurnsCpuOnce(ReferenceEngine):
    burned = False

    def new_step(self):
        if not BurnsCpuOnce.burned:
            BurnsCpuOnce.burned = True
            end = time.thread_time() + float(os.environ[BURN_ENV])
            while time.thread_time() < end:
                pass
        return super().new_step()


def make_burns_cpu_once(layout: KVCacheLayout) -> ReferenceEngine:
    return BurnsCpuOnce(layout)


def make_full_only(layout: KVCacheLayout) -> ReferenceEngine:
    return ReferenceEngine(layout)


make_full_only.spec_types = ("full",)


def _small_full_layouts() -> st.SearchStrategy[KVCacheLayout]:
    return st.builds(
        lambda blocks: KVCacheLayout(
            groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
            num_blocks=blocks,
            max_model_len=32,
        ),
        st.integers(min_value=4, max_value=12),
    )


def _miscounts(layout: KVCacheLayout) -> Broken:
    def rewrite(answer, engine):
        return answer - 1 if 0 < answer < layout.num_blocks - 1 else answer

    return Broken(layout, "num_free_blocks", rewrite)


ENGINE_WITH_STRATEGY = EngineUnderTest(
    name="miscounts-with-strategy",
    factory=_miscounts,
    spec_types=("full",),
    layout_strategy=_small_full_layouts,
)


def make_plain(layout: KVCacheLayout) -> Broken:
    """The reference's answers, without the serving calls (so the CLI says the checks
    that need them are off)."""
    return Broken(layout, "no call has this name", lambda answer, engine: answer)
