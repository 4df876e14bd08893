"""A Trainer(strategy="zero3") run started by a real launcher (Lightning's script re-run,
torchrun, a SLURM allocation, several nodes); each rank writes what it saw as JSON.

    python tests/launched_fit.py OUT_DIR --devices 2 [--num-nodes 1] [--accelerator cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from lightning_helpers import lit_module_class, loader, quiet_trainer  # noqa: E402

import zero_strategy  # noqa: E402, F401

STEPS = 4


def fit(out: str, devices: int, num_nodes: int = 1, accelerator: str = "cpu") -> dict:
    """Fit the small module for STEPS steps; this rank's report, also written to
    OUT/rank{global rank}.json. Also run in forked ranks (tests/distributed.py), as a
    one-node reference."""
    world = devices * num_nodes
    trainer = quiet_trainer(
        devices,
        "zero3",
        num_nodes=num_nodes,
        accelerator=accelerator,
        max_steps=STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        num_sanity_val_steps=0,
    )
    module = lit_module_class()()
    trainer.fit(module, loader(n_batches=2 * STEPS, world=world))
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "cluster": type(trainer.strategy.cluster_environment).__name__,
        "launcher": type(trainer.strategy.launcher).__name__ if trainer.strategy.launcher else None,
        "engine_world": trainer.strategy.engine.world_size,
        "losses": module.losses,
    }
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    held = trainer.strategy.engine.memory_report()["gathered_parameters"]
    assert held == 0, f"{held} bytes of parameters still gathered (or being gathered) after fit"
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    report = fit(args.out, args.devices, args.num_nodes, args.accelerator)
    # Tear the process groups down before the interpreter does: a gloo group destroyed
    # during interpreter shutdown can abort ("terminate called without an active exception").
    torch.distributed.destroy_process_group()
    print(f"rank {report['rank']} done", flush=True)


if __name__ == "__main__":
    main()
