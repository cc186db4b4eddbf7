"""``reference/`` imports only the standard library (checked in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

THIRD_PARTY = (
    "numpy",
    "torch",
    "hypothesis",
    "pytest",
    "properties",
    "optimized",
    "triton",
    "vllm",
    "sglang",
    "lmdeploy",
    "cbor2",
    "xxhash",
)

SCRIPT = f"""
import importlib, pkgutil, sys
import reference
names = [m.name for m in pkgutil.walk_packages(reference.__path__, "reference.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {THIRD_PARTY!r})
print(len(names))
print(",".join(bad))
"""


def test_reference_imports_only_the_standard_library() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    count, bad = result.stdout.splitlines()
    assert int(count) >= 15  # every submodule, managers included, was imported
    assert bad == ""
