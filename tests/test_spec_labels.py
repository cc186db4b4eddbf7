"""Every rule label (``I1``, ``H2``, ``W3`` ...) and section (``§7``) that a docstring or
comment of the packages cites is defined in ``docs/spec.md``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
LABEL = re.compile(r"\b([IAWHFRPXTC][1-9])\b")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)?)")


def _cited() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for package in ("reference", "optimized", "properties"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for match in LABEL.finditer(text):
                cited.setdefault(match.group(1), set()).add(str(path.relative_to(ROOT)))
            for match in SECTION.finditer(text):
                cited.setdefault("§" + match.group(1), set()).add(str(path.relative_to(ROOT)))
    return cited


def test_cited_labels_are_defined() -> None:
    cited = _cited()
    assert "H2" in cited and "§7" in cited  # the scan finds citations at all
    defined_labels = set(re.findall(r"\*\*([IAWHFRPXTC][1-9])\*\*", SPEC))
    defined_sections = {"§" + s for s in re.findall(r"^## §(\d+(?:\.\d+)?)", SPEC, re.M)}
    missing = {
        label: sorted(where)
        for label, where in cited.items()
        if label not in defined_labels | defined_sections
    }
    assert not missing, f"labels cited but not defined in docs/spec.md: {missing}"
