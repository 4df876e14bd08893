#!/usr/bin/env bash
# The test suite: lint, then pytest (multi-process tests run 2-4 gloo ranks on CPU).
# Two pytest workers by default: most tests wait on process start-up and collectives, so
# two halve the wall time even on 2 cores. ZERO_TEST_WORKERS=0 runs in one process.
# Work stealing: a worker left idle takes tests queued for the other, so the long compile
# and fault tests do not leave one worker running alone at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
"$PY" -m ruff check .
WORKERS="${ZERO_TEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then
  exec "$PY" -m pytest -q "$@"
fi
exec "$PY" -m pytest -q -n "$WORKERS" --dist worksteal --durations=25 "$@"
