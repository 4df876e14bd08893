#!/usr/bin/env bash
# The main job: a small GPT trained with ZeRO stage 3 on 2 CPU processes (gloo), the
# loss printed as it goes down, memory per rank, and the consolidated model written.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
export OMP_NUM_THREADS=1
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_gpt.py "$@"
