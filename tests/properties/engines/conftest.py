"""Skip engine adapter tests cleanly when their engine is not installed or importable.

``tests/properties/engines/test_<name>_adapter.py`` (``test_vllm_scheduler*.py``: vLLM)
needs ``.engines/<name>/.kvconform-complete``
(written by ``bash ci/engines/<name>``) and must run under that environment's
interpreter (``.engines/<name>/bin/python -m pytest tests/properties/engines``). Otherwise every
test of the module is skipped with the reason, e.g.
``vllm is not importable in /usr/bin/python3; run .engines/vllm/bin/python -m pytest``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUST_DIR = ROOT / "examples" / "engines" / "rust-block-manager"

#: engine name -> top-level package that must be importable.
ENGINE_PACKAGES: dict[str, str] = {"vllm": "vllm", "sglang": "sglang", "lmdeploy": "lmdeploy"}


def engine_skip_reason(name: str) -> str | None:
    """Why the tests of engine ``name`` cannot run here, or ``None`` if they can."""
    marker = ROOT / ".engines" / name / ".kvconform-complete"
    if not marker.is_file():
        return f"{marker} is missing; run `bash ci/engines/{name}` first"
    package = ENGINE_PACKAGES.get(name, name)
    if importlib.util.find_spec(package) is None:
        return (
            f"{package} is not importable in {sys.executable}; run "
            f"`.engines/{name}/bin/python -m pytest tests/properties/engines`"
        )
    return None


def _engine_of(path: Path) -> str | None:
    stem = path.stem
    if stem.startswith("test_") and stem.endswith("_adapter"):
        return stem[len("test_") : -len("_adapter")]
    if stem.startswith("test_vllm_scheduler"):  # the scheduler level drives vLLM too
        return "vllm"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[str, str | None] = {}
    for item in items:
        name = _engine_of(Path(str(item.fspath)))
        if name is None:
            continue
        if name not in reasons:
            reasons[name] = engine_skip_reason(name)
        reason = reasons[name]
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def rust_engine() -> str:
    """The Rust example engine (``examples/engines/rust-block-manager``), built (offline,
    standard library only) into its target/ folder; the path of its binary."""
    subprocess.run(
        ["cargo", "build", "--release", "--offline", "--quiet"], cwd=RUST_DIR, check=True
    )
    return str(RUST_DIR / "target" / "release" / "rust-block-manager")
