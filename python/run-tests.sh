#!/usr/bin/env bash
# The Python package's checks: ruff (format and lint), the wheel built by maturin and installed
# into a cached venv, its type stubs checked against it (mypy's stubtest), and pytest against
# the real kvtier-server binary.
#
#   python/run-tests.sh [pytest args...]
#
# Environment:
#   KVTIER_PY_VENV      venv to use (default: $HOME/.cache/kvtier/py-venv-<hash of
#                       requirements-test.txt and the interpreter>, made when missing)
#   KVTIER_PYTHON       interpreter to make the venv with (default: python3)
#   KVTIER_PY_SERVER_BIN   server binary to test against (default: cargo build -p kvtier-server)
#   KVTIER_PY_PROFILE   cargo profile of the wheel (default: dev; "release" as pip builds it)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
# A server binary named relative to the caller's directory: pytest runs from python/.
if [ -n "${KVTIER_PY_SERVER_BIN:-}" ]; then
  KVTIER_PY_SERVER_BIN="$(realpath "$KVTIER_PY_SERVER_BIN")"
  export KVTIER_PY_SERVER_BIN
fi
cd "$repo"

python="${KVTIER_PYTHON:-python3}"
req="$here/requirements-test.txt"
key="$( { cat "$req"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"
venv="${KVTIER_PY_VENV:-$HOME/.cache/kvtier/py-venv-$key}"
if [ ! -x "$venv/bin/python" ] || [ ! -e "$venv/.installed" ]; then
  echo "== making the test venv $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -r "$req"
  touch "$venv/.installed"
fi
py="$venv/bin/python"

echo "== ruff"
"$venv/bin/ruff" format --check "$here"
"$venv/bin/ruff" check "$here"

echo "== server binary"
if [ -z "${KVTIER_PY_SERVER_BIN:-}" ]; then
  cargo build --quiet -p kvtier-server
  target="$(cargo metadata --format-version 1 --no-deps | "$py" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  export KVTIER_PY_SERVER_BIN="$target/debug/kvtier-server"
fi
echo "$KVTIER_PY_SERVER_BIN"

echo "== wheel"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/maturin" build --quiet --profile "${KVTIER_PY_PROFILE:-dev}" \
  --manifest-path "$here/Cargo.toml" --interpreter "$py" --out "$wheels"
"$py" -m pip install --quiet --force-reinstall --no-deps "$wheels"/kvtier-*.whl

echo "== stubs"
# The type stubs against the installed module (from outside the source tree).
(cd "$wheels" && "$py" -m mypy.stubtest kvtier._kvtier)

echo "== pytest"
cd "$here"
# pytest (not `python -m pytest`): the source tree must not shadow the installed wheel.
exec "$venv/bin/pytest" -p no:cacheprovider --timeout=60 -q -rs tests "$@"
