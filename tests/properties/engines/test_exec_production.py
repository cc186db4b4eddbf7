"""The production settings and serving modes over the exec protocol
(``docs/exec-protocol.md``: ``hello``'s ``production_settings``, the ``serving_modes``
capability, ``set_in_flight``, ``cache_blocks`` and the keywords of ``allocate_slots``):

* an adapter named ``module:factory``, run in a child process by the default
  ``--isolation auto``, is driven in every production mode, exactly as in process, and a
  production-mode mutant given that way is caught (both escaped before the modes travelled);
* each call and keyword reaches the child and acts there as it does in process;
* an engine that declares none of it (the Rust example) is never sent any of it.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings

from properties.checks.registry import PropertyViolation
from properties.core.engine import (
    EngineError,
    EngineLoadError,
    RequestInput,
    SupportsServingModes,
    load_engine_factory,
)
from properties.core.modes import PRODUCTION_SETTINGS, ServingMode, production_settings
from properties.core.trace import Arrive, ResetPrefixCache, Step
from properties.engines.exec_engine import ExecEngineFactory, ExecProcess
from properties.engines.isolation import IsolatedFactory, wants_isolation
from properties.engines.reference import make_engine
from properties.engines.serve import EngineServer, answer
from properties.engines.under_test import resolve_engine
from properties.mutants.reference_mutants import MUTANT_INFO
from properties.runner import profiles as _profiles  # noqa: F401 - registers the profiles
from properties.runner.check import run_property
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from properties.tools.bench.suite import detection_settings
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

from .test_exec_engine import MISBEHAVING, SERVED_REFERENCE

REFERENCE_ADAPTER = "properties.engines.reference:make_engine"
#: The modes the production property draws for an engine that takes every setting.
EVERY_MODE = (
    "admission-gate",
    "async",
    "async-loads",
    "circular-buffer",
    "context-parallel",
    "drafts",
    "eagle-drop",
    "external-hits",
    "load-failures",
    "lookahead-hashes",
    "partial-hits",
    "retention=dense",
    "retention=interval",
    "retention=sparse",
    "rswa",
)
#: The arguments of an ``allocate_slots`` message for an engine without serving modes.
TEXTBOOK_ALLOCATE = {
    "request_id",
    "num_new_tokens",
    "num_new_computed_tokens",
    "hit",
    "num_lookahead_tokens",
}


def _layout(num_blocks: int = 8) -> KVCacheLayout:
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype_bytes=2)
    return KVCacheLayout(
        groups=(KVCacheGroup(("layer.0",), spec),), num_blocks=num_blocks, max_model_len=16
    )


def _settings(n: int) -> settings:
    return settings(settings.get_profile("ci"), max_examples=n)


# -- module:factory under the default isolation -------------------------------------------


def test_isolated_adapter_is_driven_in_every_production_mode(tmp_path) -> None:
    isolated = CheckConfig(engine=REFERENCE_ADAPTER, level="exact", failure_dir=str(tmp_path))
    assert wants_isolation(isolated.engine, isolated.isolation, isolated.call_timeout)
    engine = isolated.resolve_engine()
    factory = engine.factory
    assert isinstance(factory, IsolatedFactory)
    assert production_settings(factory) == PRODUCTION_SETTINGS
    result = run_property("production", isolated, _settings(120), seed=None, engine=engine)
    factory.close()
    assert result.failure is None, result.failure
    drawn = {tag for tag, (examples, _steps) in (result.modes or {}).items() if examples > 0}
    assert drawn == set(EVERY_MODE), result.modes
    # the same examples, the same modes, the same steps as in process
    in_process = run_property(
        "production",
        CheckConfig(engine=REFERENCE_ADAPTER, level="exact", isolation="none"),
        _settings(120),
        seed=None,
    )
    assert in_process.failure is None, in_process.failure
    assert (result.examples, result.steps, result.modes) == (
        in_process.examples,
        in_process.steps,
        in_process.modes,
    )


def test_isolated_external_mutant_is_caught_on_a_hand_trace(tmp_path) -> None:
    """The external-hit mutant in a child process, on a trace that loads from the host
    tier (r0 offloaded when it finishes, the device cache reset, r1 loads 12 tokens):
    the keywords reach the child, whose double allocation differs from the reference.
    Without the modes over exec, the child never saw the external tokens."""
    info = MUTANT_INFO["external_counted_twice"]
    config = CheckConfig(engine=info.target, level="exact", failure_dir=str(tmp_path))
    engine = config.resolve_engine()
    factory = engine.factory
    assert isinstance(factory, IsolatedFactory)
    layout = KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),), num_blocks=32, max_model_len=64
    )
    run = TraceRun(config, layout, engine, ServingMode(external_hits=True))
    try:
        run.apply(Arrive("r0", tuple(range(12)), (1,)))
        run.apply(Step(64))
        run.apply(ResetPrefixCache())
        run.apply(Arrive("r1", tuple(range(16)), (2,)))
        with pytest.raises(PropertyViolation, match="exact_match"):
            run.apply(Step(64))
    finally:
        factory.close()


@pytest.mark.parametrize("name", ["async_optimistic_free"])
def test_isolated_production_mutant_is_caught(name: str, tmp_path) -> None:
    """Without the modes over exec, the child ran the textbook mode only and passed."""
    info = MUTANT_INFO[name]
    config = CheckConfig(engine=info.target, level=info.level, failure_dir=str(tmp_path))
    engine = config.resolve_engine()
    factory = engine.factory
    assert isinstance(factory, IsolatedFactory)
    result = run_property(info.prop, config, detection_settings("ci", None), None, engine)
    factory.close()
    assert result.failure is not None, f"{name} escaped the production property in a child"
    assert any(check in result.failure for check in info.caught_by), result.failure


# -- each call and keyword, through the protocol ---------------------------------------------


def _serving_mode_calls(engine) -> list:
    """A connector load (external hit, delayed caching), its completion, an in-flight
    decode step, and an admission the gate refuses; what each call shows."""
    seen = []
    engine.add_request(RequestInput("r0", (1, 2, 3, 4, 5, 6)))
    hit = engine.get_computed_blocks("r0")
    seen.append(
        engine.allocate_slots(
            "r0", 0, 0, hit, 0, num_external_computed_tokens=4, delay_cache_blocks=True
        )
    )
    seen.append(sorted(c.num_tokens for c in engine.cached_blocks()))
    engine.cache_blocks("r0", 4)  # the load completes
    seen.append(sorted(c.num_tokens for c in engine.cached_blocks()))
    engine.set_num_computed_tokens("r0", 4)
    seen.append(engine.allocate_slots("r0", 2, 0, None, 0))
    engine.set_in_flight("r0", 2, 1)
    engine.set_num_computed_tokens("r0", 6)
    seen.append(engine.allocate_slots("r0", 1, 0, None, 0))
    engine.add_request(RequestInput("r1", (1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9)))
    hit = engine.get_computed_blocks("r1")
    seen.append(hit.num_tokens)
    # 4 new tokens after the 4 hit ones need 2 of the 3 free blocks; the whole prompt 4
    seen.append(engine.allocate_slots("r1", 4, 4, hit, 0, full_sequence_must_fit=True))
    seen.append(engine.num_free_blocks())
    hit = engine.get_computed_blocks("r1")
    seen.append(engine.allocate_slots("r1", 4, 4, hit, 0))
    seen.append(engine.ref_counts())
    seen.append(engine.last_allocation_estimate())
    return seen


def test_serving_mode_calls_reach_the_child_and_act_as_in_process() -> None:
    factory = load_engine_factory(SERVED_REFERENCE)
    assert production_settings(factory) == PRODUCTION_SETTINGS  # declared in hello
    engine = factory(_layout())
    assert isinstance(engine, SupportsServingModes)
    served = _serving_mode_calls(engine)
    assert served == _serving_mode_calls(make_engine(_layout()))
    # nothing cached until the delayed load completes; the gate refuses what fits anyway
    assert served[1] == [] and served[2] == [2, 4]
    assert served[6] is None and served[7] == 3 and served[8] == ((5, 6),)
    # the last allocation: 8 slots (bs 2) need 4 blocks, 2 are r0's hit (held, so not
    # taken from the free pool): estimate 2, reported over the protocol (A4)
    assert served[10] == 2


def make_engine_without_settings(layout: KVCacheLayout):
    """The reference engine (serving modes included) from a factory that declares no
    production setting."""
    return make_engine(layout)


def test_external_keywords_need_the_external_setting() -> None:
    # the server refuses them from a factory that does not declare "external"
    server = EngineServer(make_engine_without_settings, "plain")
    assert "production_settings" not in server.hello({"protocol": 1})
    answer({"id": 1, "call": "create", "args": {"layout": _layout_json()}}, server)
    answer({"id": 2, "call": "add_request", "args": _add_args("r0", [1, 2, 3])}, server)
    reply = answer(
        {
            "id": 3,
            "call": "allocate_slots",
            "args": {**_allocate_args("r0", 3), "num_external_computed_tokens": 2},
        },
        server,
    )
    assert reply["error"]["kind"] == "protocol_error"
    assert "'external' production setting" in reply["error"]["message"]
    # the gate alone is a serving-mode keyword: accepted
    reply = answer(
        {
            "id": 4,
            "call": "allocate_slots",
            "args": {**_allocate_args("r0", 3), "full_sequence_must_fit": True},
        },
        server,
    )
    assert reply["result"] == [[1, 2]], reply
    # and the client never sends them to such an engine
    target = f"{__name__}:make_engine_without_settings"
    factory = ExecEngineFactory(
        [sys.executable, "-m", "properties.engines.serve", target], timeout=30
    )
    assert production_settings(factory) == frozenset()
    engine = factory(_layout())
    assert isinstance(engine, SupportsServingModes)
    engine.add_request(RequestInput("r0", (1, 2, 3)))
    with pytest.raises(EngineError, match="did not declare the 'external' production setting"):
        engine.allocate_slots("r0", 3, 0, None, 0, num_external_computed_tokens=2)
    assert engine.num_free_blocks() == 7  # nothing was allocated
    factory.close()


def test_unknown_production_setting_in_hello_is_a_usage_error() -> None:
    factory = ExecEngineFactory([sys.executable, str(MISBEHAVING), "settings", "hello"], 30)
    # a declaration of the wrong type is a usage error (exit 2) naming the field
    with pytest.raises(EngineLoadError, match=r"production_settings must be .*\['warp'\]"):
        production_settings(factory)
    factory.close()


def _layout_json() -> dict:
    from properties.core.trace import layout_to_json

    return layout_to_json(_layout())


def _add_args(request_id: str, tokens: list[int]) -> dict:
    return {
        "request_id": request_id,
        "prompt_token_ids": tokens,
        "cache_salt": None,
        "lora_name": None,
    }


def _allocate_args(request_id: str, n: int) -> dict:
    return {
        "request_id": request_id,
        "num_new_tokens": n,
        "num_new_computed_tokens": 0,
        "hit": None,
        "num_lookahead_tokens": 0,
    }


# -- an engine that declares nothing ------------------------------------------------------


def test_engine_declaring_nothing_is_never_sent_the_new_calls(
    rust_engine: str, tmp_path, monkeypatch
) -> None:
    sent: list[tuple[str, frozenset[str]]] = []
    original = ExecProcess.call

    def recording_call(self, call, args=None, timeout=None):
        sent.append((call, frozenset(args or {})))
        return original(self, call, args, timeout)

    monkeypatch.setattr(ExecProcess, "call", recording_call)
    config = CheckConfig(engine=f"exec:{rust_engine}", level="universal", failure_dir=str(tmp_path))
    engine = config.resolve_engine()
    factory = engine.factory
    assert production_settings(factory) == frozenset()
    assert not isinstance(factory(_layout()), SupportsServingModes)
    result = run_property("production", config, _settings(40), seed=None, engine=engine)
    assert result.failure is None, result.failure
    assert result.examples >= 30
    # the textbook mode only, no production layout setting
    assert set(result.modes or {}) == {"retention=dense"}, result.modes
    calls = {call for call, _args in sent}
    assert "allocate_slots" in calls
    assert not calls & {"set_in_flight", "cache_blocks"}
    assert {args for call, args in sent if call == "allocate_slots"} == {
        frozenset(TEXTBOOK_ALLOCATE)
    }


def test_connector_modes_are_dropped_for_an_engine_without_the_external_setting() -> None:
    """The attention property draws connector modes (failing loads among them) for every
    engine; one with the serving calls but no ``external`` setting runs them as the
    plain synchronous mode, never with a load (a mode kept half would be invalid)."""
    config = CheckConfig(engine="reference", level="universal")
    engine = resolve_engine(make_engine_without_settings)
    result = run_property("attention", config, _settings(30), None, engine)
    assert result.failure is None, result.failure
    assert result.examples > 0
    assert result.modes is not None
    assert not {"external-hits", "async-loads", "load-failures"} & set(result.modes)
