"""What the documents promise, checked against the code.

* ``docs/ci-for-engines.md`` names the tests of ``kvconform.conformance`` (a test per
  property, per check, per listed check) and every property;
* ``docs/vllm-behaviour.md`` lists every deliberate difference from vLLM 0.33: each
  finding ``findings/vllm/README.md`` marks as a known divergence, and freeing a
  never-allocated request (the reference raises, vLLM ignores it).
"""

from __future__ import annotations

import re
from pathlib import Path

from properties.core.constants import PROPERTIES

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def test_ci_for_engines_names_the_conformance_tests() -> None:
    """The table of ``kvconform.conformance``'s tests names every property and every test
    function the module exports."""
    import kvconform.conformance as conformance

    text = (ROOT / "docs" / "ci-for-engines.md").read_text(encoding="utf-8")
    table = text[text.index("`kvconform.conformance` holds") :].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `test_")]
    assert [re.match(r"\| `(test_\w+)\[", row).group(1) for row in rows] == sorted(
        conformance.__all__, key=["test_property", "test_check", "test_xfail"].index
    )
    named = re.findall(r"`([a-z]+)`", rows[0].split("(", 1)[1].split(")", 1)[0])
    assert named == list(PROPERTIES)


def _deliberate_section() -> str:
    text = (ROOT / "docs" / "vllm-behaviour.md").read_text(encoding="utf-8")
    start = text.index("## Deliberate differences from vLLM 0.33")
    return text[start : text.index("\n## ", start + 1)]


def test_every_known_divergence_is_a_listed_difference() -> None:
    section = _deliberate_section()
    readme = (ROOT / "findings" / "vllm" / "README.md").read_text(encoding="utf-8")
    divergent = re.findall(
        r"^\| [\w-]+ \| [^|]*known divergence[^|]*\| `([\w.-]+)` \|", readme, re.M
    )
    assert len(divergent) >= 2  # the scan finds the table's rows
    missing = [f for f in divergent if f"findings/vllm/{f}" not in section]
    assert not missing, f"known divergences missing from the deliberate differences: {missing}"


def test_freeing_a_never_allocated_request_is_listed() -> None:
    section = _deliberate_section()
    row = next(line for line in section.splitlines() if "never allocated" in line)
    assert "no-op" in row and "InvalidRequestError" in row and "why" not in row
    source = (ROOT / "reference" / "kv_cache_manager.py").read_text(encoding="utf-8")
    assert "never allocated or freed twice" in source  # the behaviour the row describes
