#!/usr/bin/env bash
# Creates (or reuses) the cached Python environment of scripts/bench-mooncake.py: Mooncake Store
# from PyPI (the non-CUDA build of mooncake-transfer-engine: `mooncake_master` and the
# `mooncake.store` client), numpy, and maturin, then builds kvtier's own Python package (python/,
# release profile) into it. Prints the venv's path on stdout (progress on stderr).
#
#   venv="$(scripts/mooncake-env.sh)" && "$venv/bin/python" scripts/bench-mooncake.py --help
#
# Location: ${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}/mooncake-venv, stamped with the pins below:
# a run whose stamp matches skips pip; a changed pin rebuilds the venv. The kvtier wheel is
# rebuilt every run (cargo is incremental: a few seconds when nothing changed); set
# KVTIER_MOONCAKE_NO_WHEEL=1 to keep the installed one. The wheel's cargo target directory is
# $CARGO_TARGET_DIR when set (as for the rest of the workspace).
set -euo pipefail

python_bin="${KVTIER_MOONCAKE_PYTHON:-python3}"
pins=(mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy==2.0.2 maturin==1.16.0)

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
cache_dir="${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}"
venv="$cache_dir/mooncake-venv"
stamp_file="$venv/.kvtier-stamp"
say() { echo "mooncake-env: $*" >&2; }

command -v "$python_bin" >/dev/null 2>&1 || { say "error: no '$python_bin' on PATH (set KVTIER_MOONCAKE_PYTHON)"; exit 1; }
stamp="python=$("$python_bin" -c 'import sys; print(sys.version.split()[0])') ${pins[*]}"
if [[ ! -f "$stamp_file" || "$(cat "$stamp_file")" != "$stamp" || ! -x "$venv/bin/python" ]]; then
  say "building $venv (${pins[*]})"
  mkdir -p "$cache_dir"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2 \
    || { say "error: pip install ${pins[*]} failed (is the package index reachable?)"; exit 1; }
  echo "$stamp" > "$stamp_file"
fi

# Build the wheel unless told not to and one is installed already.
if [[ "${KVTIER_MOONCAKE_NO_WHEEL:-0}" != 1 ]] \
  || ! (cd / && "$venv/bin/python" -c 'import kvtier') >/dev/null 2>&1; then
  say "building the kvtier wheel (release) into $venv"
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  "$venv/bin/maturin" build --quiet --release --manifest-path "$repo/python/Cargo.toml" \
    --interpreter "$venv/bin/python" --out "$wheels" >&2 \
    || { say "error: maturin build failed"; exit 1; }
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
    "$wheels"/kvtier-*.whl >&2
fi
echo "$venv"
