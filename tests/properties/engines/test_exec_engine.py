"""The exec protocol (``docs/exec-protocol.md``): engines in child processes.

* the reference served by ``python -m properties.engines.serve`` passes the exact level
  through the protocol, its optional capabilities included;
* the Rust example engine (built here with cargo, standard library only) passes the
  universal level, and only layouts of its spec types are drawn;
* a hung, crashed or garbled child is reported as an engine error naming the call, with
  its exit status and the tail of its stderr, and never waited on forever.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

from properties.core.engine import (
    EngineError,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    RequestInput,
    UnsupportedLayoutError,
    load_engine_factory,
)
from properties.engines.exec_engine import (
    ExecCrashError,
    ExecEngineFactory,
    ExecProcess,
    ExecProtocolError,
    ExecTimeoutError,
)
from properties.generate.presets import PRESETS
from properties.runner import profiles as _profiles  # noqa: F401 - registers the profiles
from properties.runner.check import run_property
from properties.runner.config import CheckConfig
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec

ROOT = Path(__file__).resolve().parents[3]
MISBEHAVING = Path(__file__).with_name("misbehaving_engine.py")
SERVED_REFERENCE = f"exec:{sys.executable} -m properties.engines.serve reference"


def _layout(num_blocks: int = 8) -> KVCacheLayout:
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype_bytes=2)
    return KVCacheLayout(
        groups=(KVCacheGroup(("layer.0",), spec),), num_blocks=num_blocks, max_model_len=16
    )


def _misbehaving(mode: str, call: str, timeout: float = 30.0) -> ExecEngineFactory:
    return ExecEngineFactory([sys.executable, str(MISBEHAVING), mode, call], timeout=timeout)


def _settings(n: int) -> settings:
    return settings(settings.get_profile("ci"), max_examples=n)


# -- the reference behind the protocol ------------------------------------------------


def test_served_reference_passes_exact_level(tmp_path) -> None:
    config = CheckConfig(engine=SERVED_REFERENCE, level="exact", failure_dir=str(tmp_path))
    result = run_property("invariants", config, _settings(25), seed=None)
    assert result.failure is None, result.failure
    assert result.examples >= 20 and result.steps > 100


def test_capabilities_travel_through_the_protocol() -> None:
    factory = load_engine_factory(SERVED_REFERENCE)
    engine = factory(_layout())
    assert isinstance(engine, ExposesRefCounts)
    assert isinstance(engine, ExposesFreeQueue)
    assert isinstance(engine, ExposesCachedBlocks)
    engine.add_request(RequestInput("r0", (1, 2, 3, 4, 5)))
    hit = engine.get_computed_blocks("r0")
    assert hit.num_tokens == 0 and hit.block_ids == ((),)
    assert engine.allocate_slots("r0", 5, 0, hit, 0) == ((1, 2, 3),)
    assert engine.ref_counts() == {1: 1, 2: 1, 3: 1, 4: 0, 5: 0, 6: 0, 7: 0}
    assert engine.free_queue() == [4, 5, 6, 7]
    assert engine.num_free_blocks() == 4
    engine.set_num_computed_tokens("r0", 5)
    engine.free("r0")
    # vLLM's order, through the protocol: the partial block 3 (not cached) is reused
    # first; the cached blocks go to the back, the tail of the prefix first
    assert engine.free_queue() == [3, 4, 5, 6, 7, 2, 1]
    assert sorted((c.block_id, c.num_tokens) for c in engine.cached_blocks()) == [(1, 2), (2, 4)]
    assert engine.reset_prefix_cache() is True


def test_factory_reuses_one_child_and_retires_old_engines() -> None:
    factory = load_engine_factory(SERVED_REFERENCE)
    assert factory is load_engine_factory(SERVED_REFERENCE)
    first = factory(_layout())
    second = factory(_layout())
    assert first.process is second.process
    assert second.num_free_blocks() == 7
    with pytest.raises(EngineError, match="a newer create replaced"):
        first.num_free_blocks()


# -- the Rust example engine -------------------------------------------------------------


def test_rust_engine_passes_universal_level(rust_engine: str, tmp_path) -> None:
    config = CheckConfig(engine=f"exec:{rust_engine}", level="universal", failure_dir=str(tmp_path))
    result = run_property("invariants", config, _settings(60), seed=None)
    assert result.failure is None, result.failure
    assert result.examples >= 50


def test_rust_engine_draws_only_its_spec_types(rust_engine: str) -> None:
    from hypothesis import given

    from properties.engines.under_test import resolve_engine
    from properties.runner.run import layout_strategy

    engine = resolve_engine(f"exec:{rust_engine}")
    factory = engine.factory
    assert engine.spec_types == ("full", "sliding_window")
    kinds: set[str] = set()

    @settings(max_examples=60, database=None, derandomize=True)
    @given(layout_strategy(CheckConfig(engine=f"exec:{rust_engine}"), engine))
    def draw(layout: KVCacheLayout) -> None:
        kinds.update(spec.type_name for spec in layout.specs)

    draw()
    assert kinds == {"full", "sliding_window"}
    mamba = KVCacheLayout(
        groups=(KVCacheGroup(("m",), MambaSpec(block_size=2)),), num_blocks=4, max_model_len=8
    )
    with pytest.raises(UnsupportedLayoutError, match="mamba"):
        factory(mamba)


def test_rust_engine_rejects_a_preset_it_cannot_serve(rust_engine: str) -> None:
    from properties.engines.under_test import resolve_engine
    from properties.runner.run import layout_strategy

    assert "jamba" in PRESETS
    engine = resolve_engine(f"exec:{rust_engine}")
    with pytest.raises(Exception, match="jamba"):
        layout_strategy(CheckConfig(engine="x", preset="jamba"), engine)


# -- failures of the child -----------------------------------------------------------------


def _drive_to_allocation(factory: ExecEngineFactory):
    engine = factory(_layout())
    engine.add_request(RequestInput("r0", (1, 2, 3)))
    hit = engine.get_computed_blocks("r0")
    return engine, hit


def test_hung_engine_is_killed_and_reported_with_the_call() -> None:
    factory = _misbehaving("hang", "allocate_slots")
    engine, hit = _drive_to_allocation(factory)
    engine.process.timeout = 1.0  # only the call that hangs gets the short deadline
    start = time.monotonic()
    with pytest.raises(ExecTimeoutError) as info:
        engine.allocate_slots("r0", 3, 0, hit, 0)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "allocate_slots('r0', num_new_tokens=3" in message
    assert "within 1 s" in message and "KVCONFORM_EXEC_TIMEOUT" in message
    assert "misbehaving at allocate_slots" in message  # the child's stderr
    assert not factory.process.alive
    # the next engine gets a fresh child
    assert factory(_layout()).num_free_blocks() == 7


@pytest.mark.parametrize(
    ("mode", "status"), [("crash", "exited with status 7"), ("segfault", "killed by SIGSEGV")]
)
def test_crashed_engine_is_reported_with_its_exit_status(mode: str, status: str) -> None:
    factory = _misbehaving(mode, "get_computed_blocks")
    engine = factory(_layout())
    engine.add_request(RequestInput("r0", (1, 2, 3)))
    with pytest.raises(ExecCrashError) as info:
        engine.get_computed_blocks("r0")
    message = str(info.value)
    assert status in message and "during get_computed_blocks('r0')" in message
    assert "misbehaving at get_computed_blocks" in message


def test_a_float_block_id_is_a_protocol_violation_naming_the_call() -> None:
    factory = _misbehaving("float-ids", "allocate_slots")
    engine, hit = _drive_to_allocation(factory)
    with pytest.raises(ExecProtocolError) as info:
        engine.allocate_slots("r0", 3, 0, hit, 0)
    message = str(info.value)
    assert "allocate_slots('r0', num_new_tokens=3" in message
    assert "returned 1.0, not an integer" in message


def test_an_answer_longer_than_one_read_of_the_pipe_arrives_whole() -> None:
    factory = _misbehaving("padded", "allocate_slots")
    engine, hit = _drive_to_allocation(factory)
    # 3 tokens in blocks of 2: the first two of the 7 free blocks (block 0 is the null one)
    assert engine.allocate_slots("r0", 3, 0, hit, 0) == ((1, 2),)
    assert engine.num_free_blocks() == 5  # the next call reads the next line


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("garbage", "not JSON"), ("wrong-id", "answered with id")],
)
def test_bad_answers_are_protocol_violations(mode: str, expected: str) -> None:
    factory = _misbehaving(mode, "num_free_blocks")
    engine = factory(_layout())
    with pytest.raises(ExecProtocolError, match=expected):
        engine.num_free_blocks()


def test_error_answer_names_the_call() -> None:
    engine = _misbehaving("error", "free")(_layout())
    engine.add_request(RequestInput("r0", (1, 2, 3)))
    with pytest.raises(EngineError, match=r"free\('r0'\) failed: engine_error: nope") as info:
        engine.free("r0")
    assert "misbehaving at free" in str(info.value)  # the engine's stderr comes along
    assert engine.num_free_blocks() == 7  # the engine keeps serving after an error answer


def test_version_mismatch_is_refused() -> None:
    process = ExecProcess([sys.executable, str(MISBEHAVING), "version", "hello"])
    with pytest.raises(ExecProtocolError, match="version 99.*speaks version 1"):
        process.start()


def test_missing_command_is_a_clear_error() -> None:
    with pytest.raises(EngineError, match="cannot start"):
        ExecProcess(["/nonexistent/engine"]).start()
    with pytest.raises(EngineError, match="needs a command"):
        load_engine_factory("exec:")


def test_served_factory_that_cannot_load_reports_its_stderr() -> None:
    process = ExecProcess([sys.executable, "-m", "properties.engines.serve", "nope:nothing"])
    with pytest.raises(
        ExecCrashError, match=r"(?s)exited with status 2 during hello.*No module named .nope."
    ):
        process.start()


def test_engine_output_on_stdout_does_not_corrupt_the_protocol(tmp_path) -> None:
    module = tmp_path / "noisy_adapter.py"
    module.write_text(
        "from properties.engines.reference import ReferenceEngine\n"
        "class Noisy(ReferenceEngine):\n"
        "    def new_step(self):\n"
        "        print('a log line on stdout')\n"
        "        super().new_step()\n"
        "def make_engine(layout):\n"
        "    return Noisy(layout)\n"
    )
    process = ExecProcess(
        [sys.executable, "-m", "properties.engines.serve", "noisy_adapter:make_engine"],
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    process.start()
    process.call("create", {"layout": {**_layout_json()}})
    assert process.call("new_step") is None
    assert "a log line on stdout" in process.stderr_tail()
    process.close()


def _layout_json() -> dict:
    from properties.core.trace import layout_to_json

    return layout_to_json(_layout())


def test_cli_reports_a_crashed_engine(tmp_path, capsys) -> None:
    from properties.tools.cli import main

    # every example builds an engine, so every example meets the crash
    engine = f"exec:{sys.executable} {MISBEHAVING} crash create"
    current = settings.get_current_profile_name()  # the CLI loads its profile globally
    code = main(
        ["check", "--engine", engine, "--profile", "ci", "--only", "invariants",
         "--max-examples", "3", "--failure-dir", str(tmp_path)]
    )  # fmt: skip
    settings.load_profile(current)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 3, text  # a crashed engine broke the protocol (exit code 3)
    assert "exited with status 7 during create()" in text
    assert "misbehaving at create" in text
