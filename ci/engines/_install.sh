#!/usr/bin/env bash
# Shared body of ci/engines/{vllm,sglang,aphrodite,lmdeploy}: create .engines/NAME, install
# torch (CPU wheel, never a CUDA build), the engine --no-deps, its pinned lock file
# --no-deps, and kvconform itself --no-deps. Arguments after the import check are paths
# under site-packages (globs) removed after the install: compiled extensions the KV
# cache code never loads. Idempotent: a complete environment (marker file written
# last, naming the package and the recipe's key) is left alone.
#
# The machine's engine cache: the engine's environment without kvconform is built once
# per recipe under $KVCONFORM_ENGINE_CACHE (default ~/.cache/kvconform/engines/NAME-KEY,
# KEY a hash of everything the build reads: this script, the arguments, the lock file,
# the torchvision stub, the Python version) and each checkout's .engines/NAME is a copy
# of it made of hard links (seconds, no extra disk; a full copy where the cache is on
# another file system), into which kvconform is installed editable. A fresh clone on a
# machine that ran CI before installs no engine again; a recipe change builds a new
# entry and removes the old ones. KVCONFORM_ENGINE_CACHE= (empty) builds in place.
# Run the copies as .engines/NAME/bin/python (their bin/ scripts' shebangs name the cache).
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
key="$( { cat "${BASH_SOURCE[0]}" "$here/$name-lock.txt"
  if [ "$name" = "sglang" ]; then cat "$here/torchvision_stub.py"; fi
  printf '%s\n' "$pkg" "$import_check" "${prune[@]}" "${test_tools[@]}"
  "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"
stamp="$pkg $key"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ]; then
  # refresh kvconform itself (cheap, --no-deps) so the adapter sees the current tree
  "$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" >/dev/null
  echo "ci/engines/$name: $env is complete ($pkg, recipe $key); nothing to do"
  exit 0
fi

# build DIR: the engine's environment, without kvconform, checked by the import.
build() {
  local dir="$1"
  rm -rf "$dir"
  "$py" -m venv "$dir"
  local pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" --no-deps "$pkg"
  "${pip[@]}" --no-deps -r "$here/$name-lock.txt"
  local sp
  sp="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  for path in "${prune[@]}"; do
    # shellcheck disable=SC2086 # a glob, expanded on purpose
    rm -rf "$sp"/$path
  done
  if [ "$name" = "sglang" ]; then
    # torchvision is imported (never used) by sglang/transformers; PyPI has no CPU wheel
    cp "$here/torchvision_stub.py" "$sp/_tv_stub.py"; echo "import _tv_stub" > "$sp/zz_tv_stub.pth"
  fi
  "${pip[@]}" --no-deps "${test_tools[@]}" >/dev/null
  if ! "$dir/bin/python" -W ignore -c "$import_check"; then
    echo "ci/engines/$name: FAILED: the engine does not import in $dir" >&2
    exit 1
  fi
}

rm -rf "$env"
mkdir -p "$root/.engines"
default_cache=""
if [ -n "${XDG_CACHE_HOME:-}" ]; then default_cache="$XDG_CACHE_HOME/kvconform/engines"
elif [ -n "${HOME:-}" ]; then default_cache="$HOME/.cache/kvconform/engines"; fi
cache="${KVCONFORM_ENGINE_CACHE-$default_cache}"
if [ -n "$cache" ] && mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ]; then
  entry="$cache/$name-$key"
  if [ -f "$entry/.kvconform-cached" ]; then
    echo "ci/engines/$name: $pkg from the engine cache ($entry)"
  else
    echo "ci/engines/$name: installing $pkg into the engine cache ($entry)"
    building="$entry.building.$$"
    build "$building"
    echo "$stamp" > "$building/.kvconform-cached"
    # another run may have finished the same entry meanwhile: keep the first
    mv -T "$building" "$entry" 2>/dev/null || rm -rf "$building"
    for old in "$cache/$name"-*; do
      case "$old" in "$entry" | *.building.*) ;; *) rm -rf "$old" ;; esac
    done
  fi
  cp -al "$entry" "$env" 2>/dev/null || { rm -rf "$env"; cp -a "$entry" "$env"; }
  rm -f "$env/.kvconform-cached"
else
  echo "ci/engines/$name: installing $pkg into $env (no engine cache)"
  build "$env"
fi
"$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root"
if ! "$env/bin/python" -W ignore -c "$import_check; import properties.engines"; then
  echo "ci/engines/$name: FAILED: the engine or kvconform does not import in $env" >&2
  exit 1
fi
echo "$stamp" > "$marker"
echo "ci/engines/$name: done"
