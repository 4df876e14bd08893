#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch and the project installed in editable
# mode with its test extras. Safe to run repeatedly; prints the venv's python path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ZERO_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" >&2
fi
PY="$VENV/bin/python"
stamp="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip >&2
  # The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
  "$PY" -m pip install -q "torch==2.13.0" >&2
  "$PY" -m pip install -q -e ".[test]" >&2
  touch "$stamp"
fi
echo "$PY"
