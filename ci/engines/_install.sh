#!/usr/bin/env bash
# Shared body of ci/engines/{vllm,sglang,aphrodite,lmdeploy}: create .engines/NAME, install
# torch (CPU wheel, never a CUDA build), the engine --no-deps, its pinned lock file
# --no-deps, and kvconform itself --no-deps. Arguments after the import check are paths
# under site-packages (globs) removed after the install: compiled extensions the KV
# cache code never loads. Idempotent: a complete environment (marker file written
# last) is left alone.
set -euo pipefail
name="$1"; pkg="$2"; import_check="$3"; shift 3; prune=("$@")
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
env="$root/.engines/$name"
marker="$env/.kvconform-complete"
py="${PYTHON:-python3}"
trap 'echo "ci/engines/$name: FAILED (line $LINENO, exit $?) while installing $pkg into $env" >&2' ERR
# Test tools for `.engines/NAME/bin/python -m pytest` (installed --no-deps, so their
# own dependencies are listed too: pytest imports Pygments, which vLLM's lock happens to
# have and Aphrodite's does not), and numba (kvconform's jit extra: the bench runs here
# and times the optimized engine with its compiled loops, as .venv does).
test_tools=(setuptools wheel hypothesis==6.155.2 sortedcontainers pytest pluggy iniconfig
  Pygments==2.21.0 pytest-xdist execnet coverage numba==0.68.1 llvmlite==0.50.0)
ensure_test_tools() {
  if ! "$env/bin/python" -c 'import pytest, xdist, hypothesis, sortedcontainers, coverage, numba' 2>/dev/null; then
    "$env/bin/pip" install -q --disable-pip-version-check --no-deps "${test_tools[@]}" >/dev/null
  fi
}
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$pkg" ]; then
  ensure_test_tools
  # refresh kvconform itself (cheap, --no-deps) so the adapter sees the current tree
  "$env/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null 2>&1 || "$env/bin/pip" install -q --no-deps -e "$root"
  echo "ci/engines/$name: $env is complete ($pkg); nothing to do"
  exit 0
fi
echo "ci/engines/$name: installing $pkg into $env"
rm -rf "$env"
"$py" -m venv "$env"
pip=("$env/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" --no-deps "$pkg"
"${pip[@]}" --no-deps -r "$here/$name-lock.txt"
sp="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for path in "${prune[@]}"; do
  # shellcheck disable=SC2086 # a glob, expanded on purpose
  rm -rf "$sp"/$path
done
if [ "$name" = "sglang" ]; then
  # torchvision is imported (never used) by sglang/transformers; PyPI has no CPU wheel
  cp "$here/torchvision_stub.py" "$sp/_tv_stub.py"; echo "import _tv_stub" > "$sp/zz_tv_stub.pth"
fi
"${pip[@]}" --no-deps "${test_tools[@]}" >/dev/null
"${pip[@]}" --no-deps --no-build-isolation -e "$root"
if ! "$env/bin/python" -W ignore -c "$import_check"; then
  echo "ci/engines/$name: FAILED: the engine does not import in $env" >&2
  exit 1
fi
echo "$pkg" > "$marker"
echo "ci/engines/$name: done"
