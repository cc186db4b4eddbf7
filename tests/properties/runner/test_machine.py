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
