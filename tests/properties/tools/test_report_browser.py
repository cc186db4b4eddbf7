"""``kvconform report``: the HTML page of a known failure, loaded in headless Chromium.

The page's tables are drawn by its inline script, so finding the highlighted
(``divergent``) cell in the DOM Chromium dumps proves that the page renders. The
screenshot is kept under ``.kvconform/report.png`` (a CI artifact). Without Chromium
the test skips on a workstation and fails under CI (``CI=true``): ``ci/setup``
installs Debian's ``chromium``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from properties.core.trace import Arrive, Step, Trace, save_trace
from properties.engines.under_test import resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.engine_view import record_engine_view
from properties.tools import cli
from properties.tools.report import report_path_for, write_report
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

ROOT = Path(__file__).resolve().parents[3]
FREE_HEAD_FIRST = "properties.mutants.reference_mutants:make_free_head_first"
FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(
                "chromium is missing under CI: ci/setup installs it (apt-get install chromium)"
            )
        pytest.skip("chromium is not installed (ci/setup installs it; under CI this test fails)")
    return found


def _known_failure(directory: Path) -> Path:
    """free_head_first at the exact level: after r0 (8 tokens, blocks 1 and 2) finishes,
    the reference's free queue is [3, ..., 8, 2, 1], the mutant's [3, ..., 8, 1, 2]."""
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=9, max_model_len=64)
    failure = {
        "property": "exact_match",
        "engine": FREE_HEAD_FIRST,
        "level": "exact",
        "message": "[exact_match] free queue (front first) after free('r0')",
    }
    trace = Trace(layout, (Arrive("r0", tuple(range(1, 9))), Step(64)), failure=failure)
    # what check does when it saves a failure: the engine's side recorded in the trace
    config = CheckConfig(engine=FREE_HEAD_FIRST, level="exact")
    engine = resolve_engine(FREE_HEAD_FIRST, isolation="none")
    view = record_engine_view(trace, config, engine)
    return save_trace(dataclasses.replace(trace, engine_view=view), directory)


def test_report_is_self_contained_and_carries_the_failure(tmp_path) -> None:
    path = _known_failure(tmp_path)
    page = write_report(path).read_text(encoding="utf-8")
    assert not re.search(r"(src|href)=\"https?:", page) and "cdn" not in page.lower()
    assert "[exact_match] E1: same hits" in page
    assert f"kvconform replay {path} --engine {FREE_HEAD_FIRST} --level exact" in page
    # the CLI writes the same page and prints its path
    out = tmp_path / "out.html"
    assert cli.main(["report", str(path), "--html", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == page.replace(str(report_path_for(path)), str(out))


def test_report_renders_the_divergent_cell_in_chromium(tmp_path) -> None:
    chromium = _chromium()
    page = write_report(_known_failure(tmp_path))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    # the free queue head after the failing operation: positions 6 and 7 differ
    cells = [
        (re.search(r'data-queue-index="(\d+)"', attrs).group(1), text)
        for attrs, text in re.findall(r"<td([^>]*)>([^<]*)<", dom)
        if 'class="divergent"' in attrs and "data-queue-index" in attrs
    ]
    assert cells == [("6", "1"), ("7", "2")], dom[-3000:]
    assert 'id="rule"' in dom and 'id="calls"' in dom and "Pool" in dom
    shot = ROOT / ".kvconform" / "report.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    subprocess.run(
        [chromium, *flags, f"--screenshot={shot}", "--window-size=1400,1000", page.as_uri()],
        capture_output=True,
        timeout=180,
        check=True,
    )
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
