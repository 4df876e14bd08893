"""One rank of a run across the two namespaces of scripts/two_nodes.py (under torchrun):
the small GPT trained with the shared test loop once per entry of RUNS (a JSON list of
ZeroConfig fields, "stage" among them), in turn in the same processes: one launch (the
interpreters, torchrun's agents, the rendezvous: most of a run's seconds) for them all.
Run i saves a sharded checkpoint to OUT/i/checkpoint from every rank; the main rank
writes its losses, full state and communication report to OUT/i.

    python tests/two_nodes_worker.py OUT STEPS RUNS_JSON

The communication report is each run's last step's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # tests' helpers, and examples/ they use

from training import _global_mean, accumulate, make_model, make_optimizer  # noqa: E402
from zero_strategy import ZeroConfig, ZeroEngine  # noqa: E402

ACCUM, CLIP = 2, 0.5


def _train(out: Path, steps: int, config: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(gradient_clipping=CLIP, **config))
    losses = []
    for step in range(steps):
        if step == steps - 1:
            engine.reset_comm_report()
        total = accumulate(engine, step, rank, world, ACCUM)
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


def main() -> None:
    out, steps, runs = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    try:
        for i, config in enumerate(runs):
            _train(out / str(i), steps, config)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
