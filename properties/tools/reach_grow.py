"""Growing the reach corpus (:mod:`properties.runner.reach`): ``kvconform reach``.

* ``kvconform reach add TRACE --name NAME --why TEXT``: a trace a person wrote or a
  campaign found becomes a case, once it passes on the reference at the exact level with
  the attention check (a case must pass on a correct engine: it guards what was reached).
* ``kvconform reach grow --examples N --seed S``: draws N traces as the production
  property draws them (any layout, the deployed settings, a swarm serving mode) on the
  reference and keeps each one that reaches something no case reaches: a pair of
  features (``pair:A x B``, :mod:`properties.runner.pairs`) or a branch of the reference
  (``branch:FILE:FROM->TO``, measured with coverage.py), after minimising it (operations
  removed, one at a time from the end, while it still reaches the same new keys). The
  nightly job runs it; a person commits the new cases it writes.
* ``kvconform reach list``: the cases and what each reached.

Worked example: ``kvconform reach grow --examples 200 --seed 3`` on a corpus of one case
prints ``kept 4 of 200 traces (12 new keys: 3 pairs, 9 branches)`` and writes
``grown-3-17.json`` and three more beside the shipped cases.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

from properties.core.output_files import check_output_dir, write_text_atomic
from properties.core.trace import Operation, Trace, load_trace, validate_references
from properties.runner.config import CheckConfig
from properties.runner.pairs import all_pairs, features
from properties.runner.reach import (
    CORPUS_DIR,
    ReachCase,
    case_to_json,
    load_reach_corpus,
)
from reference.errors import KVConformError


def _reference():
    from properties.engines.under_test import resolve_engine

    return resolve_engine("reference")


def passes_on_reference(trace: Trace) -> BaseException | None:
    """None when ``trace`` passes on the reference at the exact level, with the invariants
    and then with the attention check (where it models the trace,
    :func:`properties.runner.reach.attention_models`); else the failure."""
    from properties.runner.check import config_for
    from properties.runner.reach import attention_models
    from properties.runner.run import replay_trace

    engine = _reference()
    for prop in ("invariants", "attention") if attention_models(trace) else ("invariants",):
        config = config_for(prop, CheckConfig(engine="reference", level="exact"))
        _run, error = replay_trace(trace, config, engine)
        if error is not None:
            return error
    return None


def pair_keys(trace: Trace) -> set[str]:
    """The pairs of features a trace's layout and mode reach, as corpus keys."""
    present = features(trace.layout, trace.mode)
    return {f"pair:{a} x {b}" for a, b in all_pairs() if a in present and b in present}


class BranchMeter:
    """The reference's branches one trace reaches (coverage.py, branch mode)."""

    def __init__(self) -> None:
        from properties.tools.rule_coverage import REFERENCE_DIR, new_coverage

        self.root = REFERENCE_DIR.parent
        self.cov = new_coverage(None)

    def keys(self, trace: Trace) -> set[str]:
        from properties.runner.check import config_for
        from properties.runner.run import replay_trace

        engine = _reference()
        config = config_for("invariants", CheckConfig(engine="reference", level="universal"))
        self.cov.erase()
        self.cov.start()
        try:
            replay_trace(trace, config, engine)
        finally:
            self.cov.stop()
        with tempfile.TemporaryDirectory(prefix="kvconform-reach-") as tmp:
            report = Path(tmp) / "coverage.json"
            self.cov.json_report(outfile=str(report))
            files = json.loads(report.read_text())["files"]
        keys = set()
        for path, info in files.items():  # the executed branches (not plain line arcs)
            name = Path(path).resolve().relative_to(self.root).as_posix()
            for a, b in info.get("executed_branches", []):
                keys.add(f"branch:{name}:{a}->{b}")
        return keys


def trace_keys(trace: Trace, meter: BranchMeter) -> set[str]:
    return pair_keys(trace) | meter.keys(trace)


def minimise(trace: Trace, wanted: set[str], meter: BranchMeter) -> Trace:
    """``trace`` with operations removed (one at a time, from the end) while it stays a
    valid trace that passes on the reference and reaches every key of ``wanted``."""
    ops: list[Operation] = list(trace.operations)
    i = len(ops) - 1
    while i > 0:
        candidate_ops = ops[:i] + ops[i + 1 :]
        try:
            validate_references(tuple(candidate_ops))
            candidate = dataclasses.replace(trace, operations=tuple(candidate_ops))
        except KVConformError:
            i -= 1
            continue
        if wanted <= trace_keys(candidate, meter) and passes_on_reference(candidate) is None:
            ops = candidate_ops
        i -= 1
    return dataclasses.replace(trace, operations=tuple(ops))


def draw_traces(examples: int, seed: int) -> list[Trace]:
    """``examples`` traces drawn as the production property draws them on the reference
    (layouts with the deployed settings, a swarm serving mode, a trace body)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from properties.generate import strategies as kvst
    from properties.runner.check import config_for
    from properties.runner.run import layout_strategy

    engine = _reference()
    config = config_for("production", CheckConfig(engine="reference"))
    layouts = layout_strategy(config, engine)
    drawn: list[Trace] = []

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hseed(seed)
    @given(st.data())
    def collect(data) -> None:
        layout = data.draw(layouts)
        mode = kvst.mode_for_layout(data.draw(kvst.swarm_modes()), layout)
        drawn.append(Trace(layout, data.draw(kvst.operations(layout)), mode=mode))

    collect()
    return drawn


def grow(
    examples: int, seed: int, directory: Path | str | None = None
) -> tuple[list[ReachCase], int]:
    """Keep the drawn traces that reach new keys (see the module docstring); returns the
    new cases (written to ``directory``) and the traces drawn."""
    root = Path(directory) if directory is not None else CORPUS_DIR
    check_output_dir(root, "reach corpus")
    meter = BranchMeter()
    known: set[str] = set()
    for case in load_reach_corpus(root):
        known |= trace_keys(case.trace, meter)
    kept: list[ReachCase] = []
    traces = draw_traces(examples, seed)
    for index, trace in enumerate(traces):
        new = trace_keys(trace, meter) - known
        if not new or passes_on_reference(trace) is not None:
            continue
        small = minimise(trace, new, meter)
        reached = sorted(new & trace_keys(small, meter))
        case = ReachCase(
            f"grown-{seed}-{index}",
            tuple(reached),
            f"drawn by kvconform reach grow (seed {seed}, example {index}): first reached "
            f"{len(reached)} keys",
            small,
        )
        write_case(case, root)
        known |= set(reached)
        kept.append(case)
    return kept, len(traces)


def write_case(case: ReachCase, directory: Path | str | None = None) -> Path:
    root = Path(directory) if directory is not None else CORPUS_DIR
    path = root / f"{case.name}.json"
    return write_text_atomic(path, json.dumps(case_to_json(case), indent=1) + "\n", "reach case")


def add_case(trace_path: str, name: str, why: str, reached: Iterable[str], directory=None) -> Path:
    """The trace at ``trace_path`` (its failure record dropped) as case ``name``, once it
    passes on the reference (else a usage error naming the failure)."""
    trace = dataclasses.replace(load_trace(trace_path), failure=None, engine_view=None)
    error = passes_on_reference(trace)
    if error is not None:
        raise KVConformError(
            f"{trace_path} fails on the reference ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}): a reach case must pass on a correct engine"
        )
    keys = tuple(reached) or tuple(sorted(pair_keys(trace)))
    return write_case(ReachCase(name, keys, why, trace), directory)
