"""One rank of a run across the two namespaces of scripts/two_nodes.py (under torchrun):
the small GPT at a stage, with the shared test loop; a sharded checkpoint saved to
OUT/checkpoint by every rank, and the main rank's losses, full state and communication
report written to OUT.

    python tests/two_nodes_worker.py OUT STAGE [STEPS [CONFIG_JSON]]

The communication report is the last step's; CONFIG_JSON holds more ZeroConfig fields.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # tests' helpers, and examples/ they use

from training import _global_mean, local_batch, make_model, make_optimizer  # noqa: E402
from zero_strategy import ZeroConfig, ZeroEngine  # noqa: E402

ACCUM, CLIP = 2, 0.5


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model = make_model()
        engine = ZeroEngine(
            model, make_optimizer(model), ZeroConfig(stage=stage, gradient_clipping=CLIP, **extra)
        )
        losses = []
        for step in range(steps):
            if step == steps - 1:
                engine.reset_comm_report()
            total = 0.0
            for micro in range(ACCUM):
                x, y = local_batch(step, micro, rank, world)
                with engine.no_sync() if micro < ACCUM - 1 else torch.enable_grad():
                    loss = engine(x, y) / ACCUM
                    engine.backward(loss)
                total += loss.item()
            engine.step()
            engine.zero_grad()
            losses.append(_global_mean(total))  # the union of the ranks' batches
        report = engine.comm_report()  # the last step's, before the save's collectives
        engine.save_checkpoint(out / "checkpoint")  # every rank writes its shards
        state = engine.full_state_dict()
        engine.close()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.clone() for k, v in state.items()}, str(out / "state.safetensors"))
            (out / "run.json").write_text(
                json.dumps({"world": world, "losses": losses, "comm": report})
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
