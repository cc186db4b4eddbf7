"""The GitHub Actions workflow of ``docs/ci-for-engines.md``, run as written against the
Rust example engine, with kvconform installed from its built wheel.

The wheel is built by ``ci/build-wheel`` (the script ``ci/wheel`` uses). A fresh virtual
environment stands in for the runner: its dependencies (torch, numpy, Hypothesis,
pytest, pytest-xdist) come from the environment running this test, through a ``.pth``
file naming a folder of links to its packages *without* kvconform (which would otherwise
be found there as an editable install), so nothing is downloaded and kvconform itself
comes from the wheel. A copy of ``examples/engines/rust-block-manager`` is the engine's
repository (the ``checkout`` step). Every ``run`` step of the workflow runs with
``bash -e`` in that copy, with the job's ``env``; the ``uses`` steps (checkout,
setup-python, the Rust toolchain, the artifact upload) are the runner's and are
skipped. Two variables are set for the test: ``KVCONFORM`` (the wheel instead of a git
tag) and ``KV_OPTIONS`` (the dev profile and 5 examples a property, to keep it short).
The conformance step then runs once more on a Python adapter that imports only
``kvconform`` (``examples/adapters/minimal_adapter.py``), from its own folder.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from properties.core.constants import PROPERTIES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ci-for-engines.md"
RUST = ROOT / "examples" / "engines" / "rust-block-manager"
QUICK_OPTIONS = "--kv-level universal --kv-profile dev --kv-max-examples 5"


def workflow() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The job's ``env`` and its ``(name, run script)`` steps (``uses`` steps left out),
    read from the YAML block of the document (the subset of YAML it is written in)."""
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    env = dict(re.findall(r'^      ([A-Z_]+): "(.*)"$', block, re.M))
    steps = []
    for chunk in re.split(r"^      - ", block.split("    steps:\n", 1)[1], flags=re.M)[1:]:
        if re.search(r"^\s*uses:", chunk, re.M):
            continue
        name = re.match(r"name: (.*)", chunk).group(1)
        inline = re.search(r"^        run: (?!\|)(.*)$", chunk, re.M)
        if inline:
            steps.append((name, inline.group(1)))
            continue
        body = chunk.split("        run: |\n", 1)[1]
        lines = [line[10:] for line in body.splitlines() if line.startswith(" " * 10)]
        steps.append((name, "\n".join(lines)))
    return env, steps


def test_the_workflow_is_read() -> None:
    env, steps = workflow()
    assert env["CI"] == "true" and env["KVCONFORM"].startswith("kvconform[pytest] @ ")
    assert env["KV_ENGINE"] == "exec:./target/release/rust-block-manager"
    names = [name for name, _ in steps]
    assert names == ["Install kvconform with pytest (CPU torch)", "Build the engine", "Conformance"]
    assert 'python -m pip install "$KVCONFORM"' in steps[0][1]
    assert steps[2][1].startswith("python -m pytest --pyargs kvconform.conformance")


def _dependencies_without_kvconform(folder: Path) -> Path:
    """A folder of links to this environment's packages, kvconform's own left out."""
    folder.mkdir()
    for packages in site.getsitepackages():
        for entry in Path(packages).iterdir():
            lowered = entry.name.lower()
            if lowered.startswith(("kvconform", "__editable__")) or lowered.endswith(".pth"):
                continue
            if lowered.split(".")[0] in ("reference", "optimized", "properties"):
                continue
            if not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.slow
def test_documented_workflow_runs_from_the_wheel(tmp_path) -> None:
    if shutil.which("cargo") is None:
        pytest.fail("cargo is needed (ci/setup installs it): the workflow builds a Rust engine")
    wheel = Path(
        subprocess.run(
            ["bash", str(ROOT / "ci" / "build-wheel"), str(tmp_path / "dist")],
            env={**os.environ, "PYTHON": sys.executable},
            capture_output=True, text=True, check=True, timeout=300,
        ).stdout.strip()
    )  # fmt: skip
    assert wheel.is_file() and wheel.name.startswith("kvconform-")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    venv_site = next((venv / "lib").glob("python3*/site-packages"))
    deps = _dependencies_without_kvconform(tmp_path / "deps")
    (venv_site / "zz_test_dependencies.pth").write_text(f"{deps}\n")

    repo = tmp_path / "engine"
    shutil.copytree(RUST, repo, ignore=shutil.ignore_patterns("target"))
    env, steps = workflow()
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL"))}
    run_env.update(env)
    run_env["KVCONFORM"] = f"kvconform[pytest] @ {wheel.as_uri()}"
    run_env["KV_OPTIONS"] = QUICK_OPTIONS
    run_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{run_env['PATH']}"
    outputs = {}
    for name, script in steps:
        proc = subprocess.run(
            ["bash", "-e", "-c", script], cwd=repo, env=run_env,
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        outputs[name] = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"step {name!r} failed:\n{outputs[name][-4000:]}"

    assert "Successfully installed kvconform-0.1.0" in outputs[steps[0][0]]
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvconform, properties; "
         "print(kvconform.__file__); print(properties.__file__)"],
        cwd=tmp_path, env=run_env, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert all(Path(p).is_relative_to(venv_site) for p in where), where
    conformance = outputs["Conformance"]
    suite = ET.parse(repo / "kvconform-junit.xml").getroot().find("testsuite")
    cases = [case.get("name") for case in suite.iter("testcase")]
    # one testcase a property, then one a check each property ran (test_check[P-C])
    assert [c for c in cases if c.startswith("test_property[")] == [
        f"test_property[{prop}]" for prop in PROPERTIES
    ]
    checks = [c for c in cases if c.startswith("test_check[")]
    assert len(checks) > len(PROPERTIES) and len(cases) == len(PROPERTIES) + len(checks)
    assert f"{len(cases)} passed" in conformance, conformance[-3000:]
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")

    python_repo = tmp_path / "python-engine"
    python_repo.mkdir()
    shutil.copy(ROOT / "examples" / "adapters" / "minimal_adapter.py", python_repo)
    run_env["KV_ENGINE"] = "minimal_adapter:make_engine"
    run_env["KV_OPTIONS"] = QUICK_OPTIONS + " -k invariants"  # the attention property is slow
    proc = subprocess.run(
        ["bash", "-e", "-c", dict(steps)["Conformance"]], cwd=python_repo, env=run_env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last, proc.stdout[-3000:]
    assert "deprecated" not in proc.stdout + proc.stderr
