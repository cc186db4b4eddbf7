"""Every rule label (``I1``, ``H2``, ``W3`` ...) and section (``§7``) that a docstring or
comment of the packages cites is defined in ``docs/spec.md``; each label is defined
there once, and every registered check names the rule whose definition names it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
LABEL = re.compile(r"\b([IAWHFRPXTCE][1-9])\b")
#: A rule's definition: a list item that starts with its bold label.
DEFINITION = re.compile(r"^- \*\*([A-Z][1-9])\*\*(.*?)(?=^- |^#|\Z)", re.M | re.S)
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
    defined_labels = set(re.findall(r"\*\*([IAWHFRPXTCE][1-9])\*\*", SPEC))
    defined_sections = {"§" + s for s in re.findall(r"^## §(\d+(?:\.\d+)?)", SPEC, re.M)}
    missing = {
        label: sorted(where)
        for label, where in cited.items()
        if label not in defined_labels | defined_sections
    }
    assert not missing, f"labels cited but not defined in docs/spec.md: {missing}"


def test_spec_labels_are_unique() -> None:
    labels = [m.group(1) for m in DEFINITION.finditer(SPEC)]
    assert len(labels) >= 25 and "X1" in labels and "E1" in labels  # the scan finds them
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    assert not repeated, f"labels defined more than once in docs/spec.md: {repeated}"


def test_every_check_is_named_by_its_rule() -> None:
    from properties.checks.registry import CHECKS

    text = {m.group(1): m.group(2) for m in DEFINITION.finditer(SPEC)}
    wrong = {
        name: check.label
        for name, check in CHECKS.items()
        if f"`{name}`" not in text.get(check.label, "")
    }
    assert not wrong, f"checks whose rule in docs/spec.md does not name them: {wrong}"
