"""The ``kvconform`` command line.

* ``kvconform check --engine NAME|module:factory [--level universal|exact]
  [--profile dev|ci|nightly|gpu] [--preset NAME] [--no-attention]``: runs the
  properties and prints a table (property, examples, steps, time, result); exit 1
  on any failure, after writing the shrunk trace and printing its replay command.
* ``kvconform fuzz --engine ... --minutes N [--workers K]``: a campaign with a live
  progress line, the Hypothesis database under ``.kvconform/``, Ctrl-C stops cleanly.
* ``kvconform replay TRACE --engine ...``: replays one trace, shows the first failure
  or divergence (operation, group, expected and observed tables).
* ``kvconform bench suite|engines|attention``: speed figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from properties.engine import EngineError

PROPERTIES = ("invariants", "attention", "determinism")


@dataclass
class PropertyResult:
    name: str
    examples: int
    steps: int
    seconds: float
    failure: str | None = None
    trace_path: Path | None = None


def _config(args: argparse.Namespace, **overrides):
    from properties.machine import CheckConfig

    fields = dict(
        engine=args.engine,
        level=getattr(args, "level", "universal"),
        preset=getattr(args, "preset", None),
        failure_dir=args.failure_dir,
    )
    fields.update(overrides)
    return CheckConfig(**fields)


def _save_failure(config, exc: BaseException) -> Path | None:
    """Give the last failing run's trace its content-addressed name."""
    from properties.machine import last_failure_path
    from properties.trace import load_trace, save_trace

    last = last_failure_path(config.failure_dir)
    if not last.exists():
        return None
    trace = load_trace(last)
    path = save_trace(trace, config.failure_dir)
    last.unlink()
    return path


def run_machine_property(name: str, config, settings, seed: int | None) -> PropertyResult:
    """Run the stateful machine under ``settings``; the result with its trace on failure."""
    from hypothesis import seed as hseed
    from hypothesis.stateful import run_state_machine_as_test

    from properties.machine import machine_for

    machine = machine_for(config, name=f"{name.capitalize()}Machine")
    if seed is not None:
        machine = hseed(seed)(machine)
    start = time.perf_counter()
    failure = None
    path = None
    try:
        run_state_machine_as_test(machine, settings=settings)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        failure = f"{type(exc).__name__}: {exc}"
        path = _save_failure(config, exc)
    return PropertyResult(
        name,
        machine.stats.examples,
        machine.stats.steps,
        time.perf_counter() - start,
        failure,
        path,
    )


def run_determinism(config, settings, seed: int | None) -> PropertyResult:
    """The same trace twice on fresh engines gives the same calls and results (H6)."""
    from hypothesis import given
    from hypothesis import seed as hseed

    from properties import strategies as kvst
    from properties.engine import load_engine_factory
    from properties.machine import TraceRun, layout_strategy
    from properties.trace import Trace, save_trace

    factory = load_engine_factory(config.engine)
    counts = {"examples": 0, "steps": 0}
    box: dict[str, object] = {}

    @settings
    @given(kvst.traces(layout_strategy(config, factory), max_ops=30))
    def determinism(trace: Trace) -> None:
        logs = []
        for _ in range(2):
            run = TraceRun(config, trace.layout, factory)
            try:
                for op in trace.operations:
                    run.apply(op)
            except (AssertionError, EngineError):
                pass  # other properties report violations; here only the calls matter
            logs.append(run.lockstep.log)
        counts["examples"] += 1
        counts["steps"] += len(trace.operations)
        if logs[0] != logs[1]:
            first = (
                next(i for i, (a, b) in enumerate(zip(logs[0], logs[1])) if a != b)
                if any(a != b for a, b in zip(logs[0], logs[1]))
                else min(map(len, logs))
            )
            box["trace"] = trace
            raise AssertionError(
                f"[determinism] call {first} differs between two runs: "
                f"{logs[0][first : first + 1]} vs {logs[1][first : first + 1]}"
            )

    if seed is not None:
        determinism = hseed(seed)(determinism)
    start = time.perf_counter()
    failure, path = None, None
    try:
        determinism()
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        failure = f"{type(exc).__name__}: {exc}"
        if "trace" in box:
            t = box["trace"]
            path = save_trace(
                Trace(
                    t.layout,
                    t.operations,
                    seed,
                    failure={
                        "property": "determinism",
                        "message": str(exc),
                        "engine": config.engine,
                        "level": config.level,
                    },
                ),
                config.failure_dir,
            )
    return PropertyResult(
        "determinism",
        counts["examples"],
        counts["steps"],
        time.perf_counter() - start,
        failure,
        path,
    )


def replay_command(path: Path | str, engine: str, level: str, attention: bool) -> str:
    """The command that replays a saved failure (``--attention`` for that property)."""
    return (
        f"kvconform replay {path} --engine {engine} --level {level}"
        f"{' --attention' if attention else ''}"
    )


def cmd_check(args: argparse.Namespace) -> int:
    from hypothesis import settings as hsettings

    from properties.machine import disabled_all_but
    from properties.profiles import load_profile

    profile = load_profile(args.profile)
    settings = hsettings(profile, max_examples=args.max_examples or profile.max_examples)
    seed = args.seed
    if seed is None and not profile.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    print(
        f"kvconform check: engine={args.engine} level={args.level} profile={args.profile} "
        f"preset={args.preset or '-'} seed={seed if seed is not None else 'derandomized'}",
        flush=True,
    )
    from properties.engine import load_engine_factory
    from properties.machine import known_divergences

    for d in known_divergences(load_engine_factory(args.engine)):
        print(
            f"  known divergence {d.name}: {d.summary}\n    layouts where it applies are "
            f"not drawn; see {d.finding}"
        )
    wanted = [p for p in PROPERTIES if not (p == "attention" and args.no_attention)]
    if args.only:
        wanted = [p for p in wanted if p in args.only]
    results = []
    for name in wanted:
        if name == "invariants":
            config = _config(args)
            results.append(run_machine_property("invariants", config, settings, seed))
        elif name == "attention":
            config = _config(args, attention=True, disabled=disabled_all_but(()))
            # numeric attention costs ~10x a symbolic step: a third of the examples
            fewer = hsettings(settings, max_examples=max(20, settings.max_examples // 3))
            results.append(run_machine_property("attention", config, fewer, seed))
        else:
            results.append(run_determinism(_config(args), settings, seed))
        r = results[-1]
        print(
            f"  {r.name:<12} {'PASS' if r.failure is None else 'FAIL'} "
            f"({r.examples} examples, {r.steps} steps, {r.seconds:.1f}s)",
            flush=True,
        )
    print(format_results(results))
    failed = [r for r in results if r.failure is not None]
    for r in failed:
        print(f"\nFAILED {r.name}: {r.failure[:4000]}")
        if r.trace_path is not None:
            command = replay_command(r.trace_path, args.engine, args.level, r.name == "attention")
            print(f"  trace: {r.trace_path}\n  replay: {command}")
    return 1 if failed else 0


def format_results(results: list[PropertyResult]) -> str:
    rows = [("property", "examples", "steps", "time", "result")]
    for r in results:
        rows.append(
            (
                r.name,
                str(r.examples),
                str(r.steps),
                f"{r.seconds:.1f}s",
                "pass" if r.failure is None else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_replay(args: argparse.Namespace) -> int:
    from properties.machine import CheckConfig, disabled_all_but, replay_trace
    from properties.trace import load_trace

    trace = load_trace(Path(args.trace))
    disabled = disabled_all_but(()) if args.attention else frozenset()
    config = CheckConfig(
        engine=args.engine,
        level=args.level,
        attention=args.attention,
        disabled=disabled,
        failure_dir=args.failure_dir,
    )
    print(
        f"replaying {args.trace}: {len(trace.operations)} operations on {trace.layout.describe()}"
    )
    if trace.failure:
        print(
            f"recorded failure: [{trace.failure.get('property')}] on "
            f"{trace.failure.get('engine')} ({trace.failure.get('level')})"
        )
    run, exc = replay_trace(trace, config)
    if exc is None:
        print(f"no failure: {args.engine} passes every check on this trace ({args.level})")
        return 0
    op_index = len(run.operations) - 1
    print(f"FAILED at operation {op_index}: {run.operations[op_index]!r}")
    print(f"  {type(exc).__name__}: {exc}")
    calls = run.lockstep.log[-6:]
    if calls:
        print("  last calls (engine under test):")
        for c in calls:
            print(f"    {json.dumps(c)}")
    if run.lockstep.reference is not None:
        print("  block tables now, per request (reference | engine):")
        for rid, tracked in run.lockstep.checker.requests.items():
            if not tracked.holds_blocks:
                continue
            try:
                exp = run.lockstep.reference.get_block_ids(rid)
                got = run.lockstep.engine.get_block_ids(rid)
            except Exception as err:  # noqa: BLE001
                print(f"    {rid}: cannot read tables: {err}")
                continue
            for gid, (e, g) in enumerate(zip(exp, got)):
                mark = "  " if list(e) == list(g) else "!="
                print(f"    {rid} group {gid}: {list(e)} {mark} {list(g)}")
    return 1


def cmd_fuzz(args: argparse.Namespace) -> int:
    from properties.fuzz import run_campaign

    return run_campaign(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "suite":
        from properties.bench_suite import bench_suite, format_suite

        print(format_suite(bench_suite(profile=args.profile)))
    elif args.what == "engines":
        from properties.bench_engines import (
            bench_engines,
            engine_mismatches,
            format_engine_bench,
            recorded_traces,
        )

        rows = bench_engines(
            engines=tuple(args.engines),
            traces=recorded_traces(scale=args.scale),
            repeat=args.repeat,
        )
        print(format_engine_bench(rows))
        return 1 if engine_mismatches(rows) else 0
    else:
        from properties.bench_attention import bench_attention, format_bench

        for backend in ("torch", "sdpa"):
            print(
                format_bench(
                    bench_attention(
                        args.device, args.seed, backend=backend, num_threads=args.threads
                    )
                )
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconform", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--engine",
            default="reference",
            help="reference, optimized, vllm, sglang, or module:factory",
        )
        p.add_argument("--level", default="universal", choices=("universal", "exact"))
        p.add_argument("--failure-dir", default=".kvconform/failures")

    p = sub.add_parser("check", help="run the properties once and print a table")
    engine_args(p)
    p.add_argument("--profile", default="ci", choices=("dev", "ci", "nightly", "gpu"))
    p.add_argument("--preset", default=None, help="draw layouts from this model preset")
    p.add_argument("--no-attention", action="store_true", help="skip the attention property")
    p.add_argument("--only", nargs="*", choices=PROPERTIES, help="run only these properties")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fuzz", help="a long campaign with a live progress line")
    engine_args(p)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--preset", default=None)
    p.add_argument("--attention", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("replay", help="replay one trace and show the first failure")
    p.add_argument("trace")
    engine_args(p)
    p.add_argument("--attention", action="store_true", help="check attention outputs only")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("bench", help="speed figures")
    p.add_argument("what", choices=("suite", "engines", "attention"))
    p.add_argument("--profile", default="ci")
    p.add_argument("--engines", nargs="*", default=["reference", "vllm"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="engines: keep the fastest of N")
    p.add_argument("--scale", type=int, default=1, help="engines: shrink the traces k times")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngineError as exc:
        print(f"kvconform: engine error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvconform: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"kvconform: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
