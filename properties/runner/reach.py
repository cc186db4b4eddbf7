"""Reach that cannot be lost: a committed corpus of traces replayed before new examples.

Every change to a strategy moves the derandomized ``ci`` stream, and a path the old stream
happened to take can vanish from the new one (in-project mutants have escaped for that
reason alone). So the traces that first reached something (a pair of features, a branch
of the reference, a path only a hand-written scenario takes) are kept in
``properties/runner/reach_corpus/`` (shipped with the package) and every ``check``
replays them, for every engine, before Hypothesis draws: a property whose corpus trace
fails is failed by it, with its trace saved like any other failure.

A case is one JSON file::

    {"format": "kvconform-reach/1", "name": "failed-async-load-retry",
     "reached": ["pair:async-loads x load-failures", "branch:reference/...:120->121"],
     "why": "a request that reads blocks of an asynchronous load that failed",
     "trace": {...a kvconform trace (docs/trace-format.md), without failure...}}

A case is replayed on an engine only where the engine can run it: its layout's spec types
among the engine's, every production setting and serving mode it uses declared
(:class:`properties.runner.pairs.Declared`, as the pair table decides). The invariants
and production properties replay every case with their checks, the attention property
with the attention check, the determinism property none (it compares two runs of the
same draws). The pairs of features a replayed case runs count in the run's pair table
like a drawn example's (a pair the stream stopped drawing stays reached while a case
runs it). ``--no-reach-corpus`` turns the replay off.

Worked example: the mutant ``delay_cache_ignored`` (an asynchronous load's blocks cached
before the load completes) escapes the ``ci`` stream, whose attention examples draw no
failed load; the corpus case ``failed-async-load-retry`` fails it at the exact level,
before the stream starts (``tests/properties/runner/test_reach.py``).

The corpus grows with :mod:`properties.tools.reach_grow` (``kvconform reach grow``:
traces that reach a pair or a reference branch no case reaches, minimised) and with
``kvconform reach add`` (a trace a person wrote or a campaign found).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from properties.core.engine import KnownDivergenceMet, UnsupportedLayoutError
from properties.core.json_input import InputError, read_json
from properties.core.trace import Trace, TraceFormatError, trace_from_json, trace_to_json
from properties.engines.under_test import EngineUnderTest
from properties.runner.config import CheckConfig
from properties.runner.pairs import Declared, count_pairs, features
from properties.runner.run import replay_trace
from reference.errors import KVConformError
from reference.specs import MambaSpec

REACH_FORMAT = "kvconform-reach/1"
#: The corpus shipped with the package.
CORPUS_DIR = Path(__file__).with_name("reach_corpus")
#: The largest case file read.
MAX_CASE_BYTES = 8 * 1024 * 1024
#: The properties that replay the corpus, and whether with the attention check.
REPLAYED_BY = {"invariants": False, "production": False, "attention": True}


class ReachCorpusError(KVConformError):
    """A reach corpus case that cannot be read (a usage error, exit 2)."""


@dataclass(frozen=True)
class ReachCase:
    """One kept trace: its name, what it reached, why it was kept, and the trace."""

    name: str
    reached: tuple[str, ...]
    why: str
    trace: Trace

    def features(self) -> frozenset[str]:
        return features(self.trace.layout, self.trace.mode)


def case_to_json(case: ReachCase) -> dict:
    return {
        "format": REACH_FORMAT,
        "name": case.name,
        "reached": list(case.reached),
        "why": case.why,
        "trace": trace_to_json(case.trace),
    }


def case_from_json(data: object, where: str) -> ReachCase:
    if not isinstance(data, dict) or data.get("format") != REACH_FORMAT:
        raise ReachCorpusError(f"{where}: not a kvconform reach case (format {REACH_FORMAT!r})")
    name, reached, why = data.get("name"), data.get("reached"), data.get("why", "")
    if not isinstance(name, str) or not name:
        raise ReachCorpusError(f"{where}: 'name' must be a non-empty string")
    if not isinstance(reached, list) or not all(isinstance(k, str) for k in reached):
        raise ReachCorpusError(f"{where}: 'reached' must be a list of strings")
    if not isinstance(why, str):
        raise ReachCorpusError(f"{where}: 'why' must be a string")
    try:
        trace = trace_from_json(data.get("trace"), f"{where}.trace")
    except TraceFormatError as exc:
        raise ReachCorpusError(str(exc)) from None
    return ReachCase(name, tuple(reached), why, trace)


def load_reach_corpus(directory: Path | str | None = None) -> list[ReachCase]:
    """Every case of the corpus (default: the shipped one), in file-name order."""
    root = Path(directory) if directory is not None else CORPUS_DIR
    if not root.is_dir():
        return []
    cases = []
    for path in sorted(root.glob("*.json")):
        try:
            data = read_json(path, "reach corpus case", MAX_CASE_BYTES)
        except InputError as exc:
            raise ReachCorpusError(str(exc)) from None
        cases.append(case_from_json(data, str(path)))
    return cases


def runnable_cases(
    cases: Iterable[ReachCase], engine: EngineUnderTest, serving_calls: bool
) -> list[ReachCase]:
    """The cases ``engine`` can run: every feature of the case's layout and mode declared
    (``serving_calls``: whether the built engine offers the serving-mode calls)."""
    declared = Declared.of(engine, serving_calls)
    kept = []
    for case in cases:
        if any(declared.supports(f) is not None for f in case.features()):
            continue
        if _uses_mamba_modes(case.trace.layout) and "mamba_modes" not in declared.settings:
            continue  # a Mamba mode, speculative or checkpoint blocks: a production setting
        if any(
            not d.checks and d.applies_to(case.trace.layout, case.trace.mode)
            for d in engine.known_divergences
        ):
            continue  # a documented behaviour of the engine (its finding), never a failure
        kept.append(case)
    return kept


def _uses_mamba_modes(layout) -> bool:
    """Whether a Mamba group of ``layout`` leaves the default settings (align mode, no
    speculative or prefill checkpoint blocks): the ``mamba_modes`` production setting."""
    return any(
        isinstance(s, MambaSpec)
        and (not s.is_align or s.num_speculative_blocks or s.num_prefill_checkpoint_blocks)
        for s in layout.specs
    )


@dataclass
class ReachReplay:
    """What replaying the corpus gave one property: the cases replayed, and the first
    that failed with its error (None: every one passed)."""

    replayed: int
    failed: ReachCase | None = None
    error: BaseException | None = None
    trace: Trace | None = None
    #: the pairs of features the replayed cases ran (pair -> cases), which count in the
    #: run's pair table like drawn examples
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)


def attention_models(trace: Trace) -> bool:
    """Whether the attention check can replay ``trace``: not with draft tokens (the
    attention property draws none; a draft's K/V and a Mamba state after a rollback are
    not in its content model), nor on a layout it does not model (R-SWA, circular buffers:
    :func:`properties.checks.attention.models_layout`). Example: a trace of mode
    ``num_draft_tokens = 2`` is replayed by the invariants and production properties only."""
    from properties.checks.attention import models_layout

    drafts = trace.mode is not None and trace.mode.num_draft_tokens
    return not drafts and models_layout(trace.layout)


def replay_reach(
    prop: str, config: CheckConfig, engine: EngineUnderTest, cases: list[ReachCase]
) -> ReachReplay:
    """Replay ``cases`` for property ``prop`` (``config`` as the property runs), stopping
    at the first failure."""
    if prop not in REPLAYED_BY:
        return ReachReplay(0)
    from properties.runner.run import active_checks_for, excused_config, replayed_trace

    try:
        serving = "serving_modes" in active_checks_for(engine, config)[1]
    except KVConformError:  # the engine cannot be built: the property reports it
        return ReachReplay(0)
    replayed = 0
    pairs: dict[tuple[str, str], int] = {}
    for case in runnable_cases(cases, engine, serving):
        if REPLAYED_BY[prop] and not attention_models(case.trace):
            continue
        # as a drawn example of its layout runs: without the checks a divergence excuses
        run, error = replay_trace(
            case.trace, excused_config(config, engine, case.trace.layout), engine
        )
        if run is None and isinstance(error, UnsupportedLayoutError):
            continue  # a layout the engine refuses is not a case for it (as in a draw)
        if isinstance(error, KnownDivergenceMet):
            continue  # a documented divergence of the engine: the case stops, uncounted
        replayed += 1
        count_pairs(pairs, features(case.trace.layout, case.trace.mode))
        if error is not None:
            return ReachReplay(
                replayed, case, error, replayed_trace(case.trace, run, error, config)
            )
    return ReachReplay(replayed, pairs=pairs)
