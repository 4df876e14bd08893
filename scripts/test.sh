#!/usr/bin/env bash
# The test suite: lint, then pytest (multi-process tests run 2-4 gloo ranks on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
"$PY" -m ruff check .
exec "$PY" -m pytest -q "$@"
