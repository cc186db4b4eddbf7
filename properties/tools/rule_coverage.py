"""Rule coverage: which rules of ``reference/`` a run exercised, measured by coverage.py.

Each rule of the reference is a branch of its code, so branch coverage of ``reference/``
under a run says which rules the run reached (``kvconform check --coverage``). The
report has one row per module (statements, branches, percent), the functions that are
not fully covered, and a table of every unreached branch: ``file:line``, where the
branch would have gone (``->N``; ``->exit`` leaves the function), the function and the
source line.

:data:`GATED` names the modules whose every branch the ``ci`` profile must reach (CI
enforces it, ``tests/properties/tools/test_rule_coverage.py``). A branch that no correct
call sequence can reach carries ``# pragma: no cover`` with its reason; the patterns of
:data:`EXCLUDED` drop the argument-validation raises of the reference (a correct
scheduler never makes an invalid call; ``tests/reference/test_errors.py`` covers them).

Worked example of a table row::

    reference/managers/sliding_window.py:66->67  SlidingWindowManager.find_longest_cache_hit
        if run == 0 and bs != alignment and ((i + 1) * bs) % alignment != 0:

says that no lookup met a cached window block ending off the hit alignment.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import reference

#: The reference's source directory (what is measured).
REFERENCE_DIR = Path(reference.__file__).resolve().parent
#: Modules (paths relative to the repository root) the ci profile must cover fully.
GATED = (
    "reference/managers/",
    "reference/coordinator.py",
    "reference/block_pool.py",
    "reference/kv_cache_manager.py",
)
#: Lines excluded from measurement (regex -> why no correct run reaches them).
EXCLUDED = {
    r"raise InvalidRequestError\(": "argument validation: a correct scheduler never "
    "makes the invalid call (tests/reference/test_errors.py does)",
    r"raise PoolExhaustedError\(": "callers check the free count first; reaching it is a "
    "bug of the reference itself",
    r"raise NotImplementedError": "abstract method",
}


class CoverageUnavailableError(RuntimeError):
    """coverage.py is not installed (it comes with the ``test`` extra)."""


def _coverage_module():
    try:
        import coverage
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CoverageUnavailableError(
            "--coverage needs coverage.py: pip install 'kvconform[test]' (or coverage)"
        ) from exc
    return coverage


def new_coverage(data_file: str | None = None):
    """A ``coverage.Coverage`` measuring branches of ``reference/`` only."""
    coverage = _coverage_module()
    cov = coverage.Coverage(
        data_file=data_file,
        data_suffix=data_file is not None,
        branch=True,
        source=[str(REFERENCE_DIR)],
        config_file=False,
    )
    for pattern in EXCLUDED:
        cov.exclude(pattern)
    return cov


@dataclass(frozen=True)
class UnreachedBranch:
    """A branch (``target`` the line it jumps to, ``None`` for a missed statement,
    ``-1`` for leaving the function) that no call reached."""

    path: str
    line: int
    target: int | None
    function: str
    source: str

    @property
    def where(self) -> str:
        if self.target is None:
            return f"{self.path}:{self.line}"
        return f"{self.path}:{self.line}->{'exit' if self.target < 0 else self.target}"


@dataclass(frozen=True)
class ModuleRow:
    path: str
    statements: int
    missed_statements: int
    branches: int
    missed_branches: int
    percent: float


@dataclass(frozen=True)
class RuleCoverage:
    """The result: rows per module, per function (the incomplete ones), unreached."""

    modules: tuple[ModuleRow, ...]
    functions: tuple[tuple[str, str, float], ...]
    unreached: tuple[UnreachedBranch, ...] = field(default=())

    @property
    def percent(self) -> float:
        covered = sum(
            m.statements - m.missed_statements + m.branches - m.missed_branches
            for m in self.modules
        )
        total = sum(m.statements + m.branches for m in self.modules)
        return 100.0 * covered / total if total else 100.0

    def unreached_in(self, prefixes: Sequence[str] = GATED) -> list[UnreachedBranch]:
        return [u for u in self.unreached if u.path.startswith(tuple(prefixes))]


def _relative(path: str) -> str:
    resolved = Path(path).resolve()
    return str(Path("reference") / resolved.relative_to(REFERENCE_DIR))


def analyse(cov) -> RuleCoverage:
    """Turn measured data into a :class:`RuleCoverage` (coverage.py's JSON report,
    which has per-function regions)."""
    with tempfile.TemporaryDirectory(prefix="kvconform-cov-") as tmp:
        out = os.path.join(tmp, "coverage.json")
        cov.json_report(outfile=out)
        data = json.loads(Path(out).read_text())
    modules: list[ModuleRow] = []
    functions: list[tuple[str, str, float]] = []
    unreached: list[UnreachedBranch] = []
    for file_name, info in sorted(data["files"].items(), key=lambda kv: _relative(kv[0])):
        rel = _relative(file_name)
        s = info["summary"]
        modules.append(
            ModuleRow(
                rel,
                s["num_statements"],
                s["missing_lines"],
                s.get("num_branches", 0),
                s.get("missing_branches", 0),
                s["percent_covered"],
            )
        )
        source = Path(file_name).read_text().splitlines()
        owner: dict[int, str] = {}
        for name, region in info.get("functions", {}).items():
            lines = region["executed_lines"] + region["missing_lines"]
            for line in lines:
                owner[line] = name or "(module)"
            rs = region["summary"]
            if name and rs["percent_covered"] < 100.0:
                functions.append((rel, name, rs["percent_covered"]))
        branch_sources = {a for a, _ in info.get("missing_branches", [])}
        for line in info["missing_lines"]:
            if line in branch_sources:
                continue  # reported as the branch that leads to it
            unreached.append(
                UnreachedBranch(rel, line, None, owner.get(line, "(module)"), source[line - 1])
            )
        for a, b in info.get("missing_branches", []):
            unreached.append(
                UnreachedBranch(rel, a, b, owner.get(a, "(module)"), source[a - 1].strip())
            )
    unreached.sort(key=lambda u: (u.path, u.line, u.target or 0))
    return RuleCoverage(tuple(modules), tuple(functions), tuple(unreached))


def combine(data_files: Sequence[str]):
    """A ``coverage.Coverage`` holding the union of the workers' data files."""
    cov = new_coverage()
    cov.combine(list(data_files), keep=False)
    return cov


def format_rule_coverage(result: RuleCoverage, gated: Sequence[str] = GATED) -> str:
    """The report ``kvconform check --coverage`` prints (see the module docstring)."""
    lines = [f"rule coverage of reference/ (branch coverage): {result.percent:.1f}%"]
    header = ("module", "stmts", "miss", "branches", "miss", "cover")
    rows = [header] + [
        (
            m.path,
            str(m.statements),
            str(m.missed_statements),
            str(m.branches),
            str(m.missed_branches),
            f"{m.percent:.0f}%",
        )
        for m in result.modules
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if result.functions:
        lines.append("functions not fully covered:")
        for path, name, pct in result.functions:
            lines.append(f"  {pct:5.1f}%  {path}  {name}")
    gated_unreached = result.unreached_in(gated)
    lines.append(
        f"unreached branches: {len(result.unreached)} "
        f"({len(gated_unreached)} in the gated modules {', '.join(gated)})"
    )
    for u in result.unreached:
        mark = "*" if u in gated_unreached else " "
        lines.append(f" {mark}{u.where:<48} {u.function:<44} {u.source.strip()}")
    return "\n".join(lines)
