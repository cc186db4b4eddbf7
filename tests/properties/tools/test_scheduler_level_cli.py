"""``kvconform check --engine vllm-scheduler``: usage errors are one line and exit 2.

The level itself (vLLM's scheduler) is tested in
``tests/properties/engines/test_vllm_scheduler.py`` under vLLM's interpreter.
"""

from __future__ import annotations

import pytest

from properties.tools.cli import main


def test_the_scheduler_level_is_exact_only(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--engine", "vllm-scheduler", "--level", "universal", "-q"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvconform check: --engine vllm-scheduler runs at --level exact only"]
