"""Deliberately broken engines and adapters for ``test_broken_inputs.py`` (test fixtures,
not part of the package). Each breaks one thing: an answer of the wrong type, shape or
range, an exception, a hang, a factory that fails or rejects every layout.

:class:`Broken` forwards every call to the reference engine and lets a ``rewrite``
function replace the answer of one call: ``BROKEN["hit_none"]`` answers ``None`` to every
``get_computed_blocks``. Name one on the command line as
``tests.properties.tools.broken_engines:make_<name>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from properties.core.engine import CachedBlock, CacheHit, UnsupportedLayoutError
from properties.engines.reference import ReferenceEngine
from properties.engines.under_test import EngineUnderTest
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


class Broken:
    """The reference engine, with the answer of call ``method`` passed through ``rewrite``
    (``rewrite(answer, engine) -> new answer``)."""

    name = "broken"

    def __init__(self, layout: KVCacheLayout, method: str, rewrite: Callable) -> None:
        self.ref = ReferenceEngine(layout)
        self.layout = layout
        self.method = method
        self.rewrite = rewrite

    def _answer(self, method: str, answer: Any) -> Any:
        return self.rewrite(answer, self) if method == self.method else answer

    def add_request(self, request):
        return self._answer("add_request", self.ref.add_request(request))

    def append_output_tokens(self, request_id, token_ids):
        answer = self.ref.append_output_tokens(request_id, token_ids)
        return self._answer("append_output_tokens", answer)

    def set_num_computed_tokens(self, request_id, n):
        answer = self.ref.set_num_computed_tokens(request_id, n)
        return self._answer("set_num_computed_tokens", answer)

    def new_step(self):
        return self._answer("new_step", self.ref.new_step())

    def get_computed_blocks(self, request_id):
        hit = self.ref.get_computed_blocks(request_id)
        out = self._answer("get_computed_blocks", hit)
        return out

    def allocate_slots(self, request_id, n, n_hit=0, hit=None, lookahead=0):
        return self._answer(
            "allocate_slots", self.ref.allocate_slots(request_id, n, n_hit, hit, lookahead)
        )

    def free(self, request_id):
        return self._answer("free", self.ref.free(request_id))

    def remove_request(self, request_id):
        return self._answer("remove_request", self.ref.remove_request(request_id))

    def reset_prefix_cache(self):
        return self._answer("reset_prefix_cache", self.ref.reset_prefix_cache())

    def get_block_ids(self, request_id):
        return self._answer("get_block_ids", self.ref.get_block_ids(request_id))

    def num_free_blocks(self):
        return self._answer("num_free_blocks", self.ref.num_free_blocks())

    def ref_counts(self):
        return self._answer("ref_counts", self.ref.ref_counts())

    def free_queue(self):
        return self._answer("free_queue", self.ref.free_queue())

    def cached_blocks(self):
        return self._answer("cached_blocks", self.ref.cached_blocks())


def _raise(exc: BaseException) -> Callable:
    def rewrite(answer, engine):
        raise exc

    return rewrite


def _first_row(fn: Callable) -> Callable:
    """Rewrite group 0 of a table (or of new ids) with ``fn(row) -> row``."""

    def rewrite(answer, engine):
        if answer is None:
            return None
        return (fn(tuple(answer[0])), *answer[1:])

    return rewrite


def _hang_loop(answer, engine):
    while True:
        pass


def _hang_sleep(answer, engine):
    time.sleep(3600)


def _hang_regex(answer, engine):
    # catastrophic backtracking: C code holding the GIL (it checks signals, though)
    re.match(r"(a+)+$", "a" * 40 + "b")
    return answer


def _hang_c(answer, engine):
    # C code holding the GIL that never checks for signals: needs a child process
    sum(itertools.repeat(1, 10**13))
    return answer


def _swallowing_loop(answer, engine):
    # an engine that catches every Exception around its work still stops at the deadline
    while True:
        with contextlib.suppress(Exception):
            time.sleep(0.01)


#: name -> (method, rewrite, the message the harness must give, a part of one line)
BROKEN: dict[str, tuple[str, Callable, str]] = {
    "hit_none": ("get_computed_blocks", lambda a, e: None, "returned None, not a CacheHit"),
    "hit_tuple": (
        "get_computed_blocks",
        lambda a, e: (a.block_ids, a.num_tokens),
        "not a CacheHit",
    ),
    "hit_str_tokens": (
        "get_computed_blocks",
        lambda a, e: CacheHit(a.block_ids, str(a.num_tokens)),
        "as num_tokens, not an integer",
    ),
    "hit_negative_tokens": (
        "get_computed_blocks",
        lambda a, e: CacheHit(a.block_ids, -1),
        "hit of -1 tokens",
    ),
    "hit_extra_group": (
        "get_computed_blocks",
        lambda a, e: CacheHit((*a.block_ids, ()), a.num_tokens),
        "groups, the layout has",
    ),
    "hit_block_out_of_range": (
        "get_computed_blocks",
        lambda a, e: CacheHit(((e.layout.num_blocks,), *a.block_ids[1:]), a.num_tokens),
        "in the hit for group 0, outside [0,",
    ),
    "table_none": ("get_block_ids", lambda a, e: None, "returned None, not a sequence"),
    "table_none_group": (
        "get_block_ids",
        lambda a, e: (None, *a[1:]),
        "returned None for group 0, not a sequence of block ids",
    ),
    "table_str": ("get_block_ids", lambda a, e: "1,2", "not a sequence of"),
    "table_negative_id": (
        "get_block_ids",
        _first_row(lambda row: (-1, *row[1:])),
        "returned block id -1 for group 0",
    ),
    "table_id_too_big": (
        "get_block_ids",
        _first_row(lambda row: (999_999, *row[1:])),
        "returned block id 999999 for group 0, outside [0,",
    ),
    "table_float_id": (
        "get_block_ids",
        _first_row(lambda row: (float(row[0]), *row[1:])),
        "for group 0, not an integer (float)",
    ),
    "table_bool_id": (
        "get_block_ids",
        _first_row(lambda row: (True, *row[1:])),
        "returned True for group 0, not an integer",
    ),
    "table_extra_group": (
        "get_block_ids",
        lambda a, e: (*a, ()),
        "groups, the layout has",
    ),
    "alloc_not_tail": (
        "allocate_slots",
        _first_row(lambda row: tuple(reversed(row)) if len(row) > 1 else row),
        "but the engine's table of that group then ends with",
    ),
    "alloc_null_id": (
        "allocate_slots",
        _first_row(lambda row: (0, *row[1:]) if row else (0,)),
        "0 is the null block, never a new block",
    ),
    "alloc_str": ("allocate_slots", lambda a, e: "ok" if a is not None else None, "returned 'ok'"),
    "alloc_dict": (
        "allocate_slots",
        lambda a, e: None if a is None else {0: a[0]},
        "not a sequence of",
    ),
    "free_count_negative": ("num_free_blocks", lambda a, e: -3, "returned -3, outside [0,"),
    "free_count_too_big": (
        "num_free_blocks",
        lambda a, e: e.layout.num_blocks,
        "outside [0,",
    ),
    "free_count_str": ("num_free_blocks", lambda a, e: str(a), "not an integer (str)"),
    "free_count_none": ("num_free_blocks", lambda a, e: None, "returned None, not an integer"),
    "reset_none": ("reset_prefix_cache", lambda a, e: None, "reset_prefix_cache() returned None"),
    "reset_int": ("reset_prefix_cache", lambda a, e: int(a), "not a bool"),
    "ref_counts_list": (
        "ref_counts",
        lambda a, e: list(a.items()),
        "not a mapping block id -> count",
    ),
    "ref_counts_negative": (
        "ref_counts",
        lambda a, e: {**a, 1: -1},
        "ref count -1 for block 1",
    ),
    "ref_counts_null_key": ("ref_counts", lambda a, e: {**a, 0: 0}, "as a key, outside [1,"),
    "free_queue_none": ("free_queue", lambda a, e: None, "free_queue() returned None"),
    "free_queue_null": ("free_queue", lambda a, e: [0, *a], "at position 0, outside [1,"),
    "cached_tuples": (
        "cached_blocks",
        lambda a, e: [(c.block_id, c.group_id, c.num_tokens) for c in a] or [(1, 0, 1)],
        "not a CachedBlock",
    ),
    "cached_bad_group": (
        "cached_blocks",
        lambda a, e: [CachedBlock(1, 99, 4)],
        "group must be in",
    ),
    "raises_add": (
        "add_request",
        _raise(KeyError("no room")),
        "raised KeyError: 'no room'",
    ),
    "raises_allocate": (
        "allocate_slots",
        _raise(RuntimeError("pool corrupted")),
        "raised RuntimeError: pool corrupted",
    ),
    "hang_loop": ("new_step", _hang_loop, "new_step() did not return within"),
    "hang_sleep": ("new_step", _hang_sleep, "new_step() did not return within"),
    "hang_regex": ("new_step", _hang_regex, "new_step() did not return within"),
    "hang_swallowing": ("new_step", _swallowing_loop, "new_step() did not return within"),
    "hang_c": ("new_step", _hang_c, "new_step"),
}


#: Answers that are well formed but impossible (a free count no pool can have): the engine
#: is wrong, a property failure of a named check (exit 1), not a protocol error (exit 3).
IMPOSSIBLE = {"free_count_negative": "pool_accounting", "free_count_too_big": "pool_accounting"}


def _factory(name: str) -> Callable:
    method, rewrite, _ = BROKEN[name]

    def make(layout: KVCacheLayout) -> Broken:
        return Broken(layout, method, rewrite)

    make.__name__ = f"make_{name}"
    return make


for _name in BROKEN:
    globals()[f"make_{_name}"] = _factory(_name)


def make_miscounts_free_blocks(layout: KVCacheLayout) -> Broken:
    """A well-formed but wrong answer: one free block too few once any is in use (a
    property failure, pool accounting I1, not a protocol error)."""

    def rewrite(answer, engine):
        return answer - 1 if 0 < answer < layout.num_blocks - 1 else answer

    return Broken(layout, "num_free_blocks", rewrite)


def make_factory_raises(layout: KVCacheLayout):
    raise RuntimeError("cannot allocate the pool")


def make_factory_returns_none(layout: KVCacheLayout):
    return None


def make_rejects_every_layout(layout: KVCacheLayout):
    raise UnsupportedLayoutError("this engine supports no layout at all")


def make_rejects_in_determinism(layout: KVCacheLayout):
    """Supports only layouts with one group (every property must honour that)."""
    if len(layout.groups) != 1:
        raise UnsupportedLayoutError("one group only")
    return ReferenceEngine(layout)


not_callable = 42


# -- adapters whose declarations are wrong (checked on load: exit 2, the field named) ----


def _declaring(name: str, **declarations: object) -> Callable:
    """A reference factory carrying ``declarations`` as function attributes."""

    def make(layout: KVCacheLayout) -> ReferenceEngine:
        return ReferenceEngine(layout)

    make.__name__ = name
    for attribute, value in declarations.items():
        setattr(make, attribute, value)
    return make


#: ``layout_strategy`` is not callable
make_strategy_not_callable = _declaring("make_strategy_not_callable", layout_strategy=42)
#: ``layout_strategy()`` returns a list of layouts, not a strategy
make_strategy_returns_list = _declaring(
    "make_strategy_returns_list",
    layout_strategy=lambda: [
        KVCacheLayout(
            groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
            num_blocks=8,
            max_model_len=32,
        )
    ],
)
#: ``layout_strategy()`` draws integers, not layouts
make_strategy_draws_int = _declaring(
    "make_strategy_draws_int", layout_strategy=lambda: st.integers(0, 3)
)
#: ``known_divergences`` names a finding instead of listing KnownDivergence values
make_bad_divergences = _declaring("make_bad_divergences", known_divergences=["vllm-bug"])
#: ``spec_types`` names a type kvconform does not have
make_unknown_spec_types = _declaring("make_unknown_spec_types", spec_types=("full", "linear"))
#: ``spec_types`` as a string (it would read as the letters f, u, l, l)
make_spec_types_string = _declaring("make_spec_types_string", spec_types="full")
#: ``production_settings`` as a string
make_settings_string = _declaring("make_settings_string", production_settings="retention")

#: An adapter exporting an EngineUnderTest (``--engine MODULE:FULL_ONLY``): the
#: reference engine, declared for full attention only.
FULL_ONLY = EngineUnderTest(
    name="full-only reference", factory=ReferenceEngine, spec_types=("full",)
)


# ---------------------------------------------------------------------------
# Issue 22: engines that corrupt kvconform's state, end the process, or fail once over
# their lifetime (a failure that does not repeat on replay)

#: ``new_step`` calls this process has answered (over every engine it built)
_LIFETIME = {"new_step": 0}
#: the ``new_step`` call (counted over the process's life) at which the engines below fail
FAIL_AT_CALL = 25


def _once_in_a_lifetime(action: Callable[[], Any]) -> Callable:
    """A rewrite of ``new_step`` that runs ``action`` at call :data:`FAIL_AT_CALL` of this
    process's life: a fresh engine replaying the same trace does not fail again."""

    def rewrite(answer, engine):
        _LIFETIME["new_step"] += 1
        if _LIFETIME["new_step"] == FAIL_AT_CALL:
            return action()
        return answer

    return rewrite


def _memory_error():
    raise MemoryError("the engine leaked until it ran out of memory")


def _garbage_on_stdout():
    """Served (``properties.engines.serve``): a garbage line on the protocol stream, the
    one pipe open for writing (fd 1 then points at stderr)."""
    for fd in range(3, 64):
        try:
            mode = os.fstat(fd).st_mode
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue
        if stat.S_ISFIFO(mode) and flags & os.O_ACCMODE == os.O_WRONLY:
            os.write(fd, b"this is not a protocol response\n")


def make_memory_error_once(layout: KVCacheLayout) -> Broken:
    """An adapter that leaks until ``MemoryError`` once, at the 25th step of its life."""
    return Broken(layout, "new_step", _once_in_a_lifetime(_memory_error))


def make_exits_once(layout: KVCacheLayout) -> Broken:
    """Served over ``exec:``: the process exits (code 7) at the 25th step of its life."""
    return Broken(layout, "new_step", _once_in_a_lifetime(lambda: os._exit(7)))


def make_garbage_once(layout: KVCacheLayout) -> Broken:
    """Served over ``exec:``: a garbage line instead of an answer at the 25th step."""
    return Broken(layout, "new_step", _once_in_a_lifetime(_garbage_on_stdout))


def make_exits_zero(layout: KVCacheLayout) -> Broken:
    """In process: ``os._exit(0)`` at the third ``new_step`` (no verdict may follow)."""
    calls = itertools.count(1)

    def rewrite(answer, engine):
        if next(calls) == 3:
            os._exit(0)
        return answer

    return Broken(layout, "new_step", rewrite)


def make_sys_exit_zero(layout: KVCacheLayout) -> Broken:
    """In process: ``sys.exit(0)`` inside ``new_step`` (a SystemExit, not a pass)."""
    return Broken(layout, "new_step", lambda answer, engine: sys.exit(0))


class MutatesTokens(Broken):
    """A correct engine that empties the token list it is given once it has used it
    (its own business, as long as the list is its own copy)."""

    def append_output_tokens(self, request_id, token_ids):
        answer = self.ref.append_output_tokens(request_id, list(token_ids))
        if isinstance(token_ids, list):
            token_ids.clear()
        return answer


def make_mutates_tokens(layout: KVCacheLayout) -> MutatesTokens:
    return MutatesTokens(layout, "", lambda answer, engine: answer)
