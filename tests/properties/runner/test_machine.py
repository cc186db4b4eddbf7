"""The stateful machine under pytest: ``pytest --kv-engine NAME --kv-level LEVEL``.

The engine and level come from the kvconform pytest plugin's options (default: the
reference at the CLI's default level); the Hypothesis profile is ours (``--kv-profile``).
A failure prints the saved trace and the command that replays it (``kv_check``).
"""

from __future__ import annotations


def test_invariants_hold(kv_check) -> None:
    result = kv_check("invariants")
    assert result.examples > 0 and result.steps > 0


def test_attention_outputs_match_dense(kv_check) -> None:
    result = kv_check("attention", level="universal")
    assert result.examples > 0


def test_every_connector_run_ends_with_a_load_from_the_host_tier(monkeypatch) -> None:
    """The attention property's connector runs end with a reload (teardown): the longest
    request comes back from the host tier, whatever rules the run drew."""
    from properties.runner import connector as connector_module
    from properties.runner.check import run_property
    from properties.runner.config import CheckConfig
    from properties.runner.profiles import load_profile

    loads: list[tuple[int, int]] = []
    original = connector_module.Connector.load

    def counting(self, state, start, end):
        loads.append((start, end))
        return original(self, state, start, end)

    monkeypatch.setattr(connector_module.Connector, "load", counting)
    config = CheckConfig(engine="reference", level="universal")
    result = run_property("attention", config, load_profile("ci"), None)
    assert result.failure is None, result.failure
    assert len(loads) >= 5 and all(end > start for start, end in loads)
