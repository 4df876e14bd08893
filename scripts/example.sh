#!/usr/bin/env bash
# The main job: a small GPT trained with Trainer(strategy="zero3") on 2 CPU processes
# (gloo), Lightning's progress bar, a sharded checkpoint written and consolidated into
# runs/lightning/consolidated/model.safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
export OMP_NUM_THREADS=1
exec "$PY" examples/train_lightning.py "$@"
