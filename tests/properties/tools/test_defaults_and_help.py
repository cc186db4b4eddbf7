"""One set of defaults (``properties.core.constants.DEFAULTS``) for ``kvconform check``
and the pytest plugin, and a ``--help`` that shows them, lists the engines, the presets
and two examples, and prints no raw markup."""

from __future__ import annotations

import argparse

from properties.core.constants import DEFAULTS
from properties.core.engine import BUILTIN_ENGINES
from properties.generate.presets import PRESETS
from properties.tools import cli, pytest_plugin


def _check_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["check"]


class _Options:
    """Records the options the plugin registers (``parser.getgroup(...).addoption``)."""

    def __init__(self) -> None:
        self.options: dict[str, dict] = {}

    def getgroup(self, name: str) -> _Options:
        return self

    def addoption(self, name: str, **kwargs) -> None:
        self.options[name] = kwargs

    def addini(self, *args, **kwargs) -> None:
        pass


def test_cli_and_plugin_share_the_defaults() -> None:
    assert DEFAULTS.profile == "ci" and DEFAULTS.level == "universal"
    args = _check_parser().parse_args([])
    recorder = _Options()
    pytest_plugin.pytest_addoption(recorder)
    plugin = {name: o.get("default") for name, o in recorder.options.items()}
    pairs = {
        "engine": (args.engine, plugin["--kv-engine"]),
        "level": (args.level, plugin["--kv-level"]),
        "max_examples": (args.max_examples, plugin["--kv-max-examples"]),
        "seed": (args.seed, plugin["--kv-seed"]),
        "call_timeout": (args.call_timeout, plugin["--kv-call-timeout"]),
        "isolation": (args.isolation, plugin["--kv-isolation"]),
    }
    for field, (from_cli, from_plugin) in pairs.items():
        assert from_cli == from_plugin == getattr(DEFAULTS, field), field
    # the plugin resolves an absent --kv-profile to the same default (pytest_configure)
    assert args.profile == DEFAULTS.profile and plugin["--kv-profile"] is None
    assert "default ci" in recorder.options["--kv-profile"]["help"]


def test_top_level_help_lists_engines_presets_and_examples() -> None:
    text = cli.build_parser().format_help()
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    for name in (*BUILTIN_ENGINES, *PRESETS, "module:factory", "exec:COMMAND"):
        assert name in text, name
    examples = text[text.index("examples:") :].splitlines()[1:]
    assert sum(line.strip().startswith("kvconform check") for line in examples) == 2


def test_check_help_shows_the_defaults() -> None:
    text = " ".join(_check_parser().format_help().split())  # argparse wraps lines
    for expected in (
        "Hypothesis profile (default: ci)",
        "property level (default: universal)",
        "(0: none) (default: 5.0)",
        "none (never) (default: auto)",
        "--engine ENGINE reference,",
        "(default: reference)",
        "examples per property (default: the profile's)",
    ):
        assert expected in text, expected
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "presets: gemma2" in text
