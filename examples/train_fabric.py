"""The same small GPT with a Fabric loop and `Fabric(strategy="zero3")`.

    python examples/train_fabric.py            # Fabric launches the 2 CPU ranks

Gradient accumulation uses `fabric.no_backward_sync`, clipping is the global norm over all
shards, and `fabric.save` writes a sharded checkpoint directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zero_strategy  # noqa: F401  (registers "zero1".."zero3")
from examples.corpus import batches, byte_tokens
from examples.gpt import GPT, GPTConfig, decay_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/fabric/ckpt")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(decay_groups(model), lr=3e-3, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    tokens = byte_tokens()
    rank, world, accum, per_rank = fabric.global_rank, fabric.world_size, 2, 4
    for step in range(args.steps):
        for micro in range(accum):
            x, y = batches(tokens, per_rank * world, cfg.block_size, step * accum + micro)
            x, y = (
                x[rank * per_rank : (rank + 1) * per_rank],
                y[rank * per_rank : (rank + 1) * per_rank],
            )
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                loss = model(x, y) / accum
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            fabric.print(
                f"step {step:3d}  loss {fabric.all_reduce(loss.detach() * accum).item():.4f}"
            )
    fabric.save(args.out, {"model": model, "optimizer": optimizer, "step": args.steps})
    fabric.print(f"sharded checkpoint written to {args.out}/")


if __name__ == "__main__":
    main()
