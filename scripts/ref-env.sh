#!/usr/bin/env bash
# Creates (or reuses) the small cached Python environment the model script and the reference
# tests need (no vLLM, no torch): gguf and numpy for scripts/fetch-model.py and
# scripts/model_reference.py, regex for the reference tokenizer, pytest. Prints its path on
# stdout (progress on stderr).
#
#   venv="$(scripts/ref-env.sh)" && "$venv/bin/python" scripts/fetch-model.py --print-dir
#
# Location: ${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}/ref-venv, stamped with the pins below: a run
# whose stamp matches returns at once; a changed pin rebuilds it.
set -euo pipefail

python_bin="${KVTIER_REF_PYTHON:-python3}"
pins=(gguf==0.19.0 numpy==2.3.5 regex==2026.11.19 pytest==8.4.2)

cache_dir="${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}"
venv="$cache_dir/ref-venv"
stamp_file="$venv/.kvtier-stamp"
say() { echo "ref-env: $*" >&2; }

command -v "$python_bin" >/dev/null 2>&1 || { say "error: no '$python_bin' on PATH (set KVTIER_REF_PYTHON)"; exit 1; }
stamp="python=$("$python_bin" -c 'import sys; print(sys.version.split()[0])') ${pins[*]}"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" && -x "$venv/bin/python" ]]; then
  echo "$venv"
  exit 0
fi
say "building $venv (${pins[*]})"
mkdir -p "$cache_dir"
rm -rf "$venv"
"$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2 \
  || { say "error: pip install ${pins[*]} failed (is the package index reachable?)"; exit 1; }
echo "$stamp" > "$stamp_file"
echo "$venv"
