#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch and the project installed in editable
# mode with its test extras. Safe to run repeatedly; prints the venv's python path.
# ZERO_TORCH picks another torch release (2.14.1 is a CUDA build, which runs on the CPU
# too) and ZERO_VENV another venv for it: the suite is checked on both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ZERO_VENV:-.venv}
TORCH=${ZERO_TORCH:-2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" >&2
fi
PY="$VENV/bin/python"
stamp="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)-torch-$TORCH"
if [ ! -f "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip >&2
  # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
  "$PY" -m pip install -q "torch==$TORCH" >&2
  "$PY" -m pip install -q -e ".[test]" >&2
  touch "$stamp"
fi
echo "$PY"
