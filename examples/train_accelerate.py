"""The same small GPT with an Accelerate loop; one line differs from plain Accelerate.

    ZERO_STRATEGY_STAGE=3 accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_accelerate.py --cpu

The stage (and any other ZeroConfig field, through ZERO_STRATEGY_CONFIG_FILE) comes from
the environment `accelerate launch` passes to every process. Accumulation is
`accelerator.accumulate`, clipping the global norm over all shards, `save_state` a sharded
checkpoint beside Accelerate's own files, and `save_model` a consolidated safetensors model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.corpus import batches, byte_tokens
from examples.gpt import GPT, GPTConfig, decay_groups
from zero_strategy.integrations.accelerate import ZeroAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo)")
    parser.add_argument("--out", default="runs/accelerate")
    args = parser.parse_args()

    accelerator = ZeroAccelerator(cpu=args.cpu, gradient_accumulation_steps=2)  # the line
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(decay_groups(model), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    tokens = byte_tokens()
    rank, world, per_rank = accelerator.process_index, accelerator.num_processes, 4
    micro_batches = args.steps * accelerator.gradient_accumulation_steps
    for micro in range(micro_batches):
        x, y = batches(tokens, per_rank * world, cfg.block_size, micro)
        x, y = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        step = micro // accelerator.gradient_accumulation_steps
        if accelerator.sync_gradients and (step % 10 == 0 or step == args.steps - 1):
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            accelerator.print(f"step {step:3d}  loss {mean:.4f}")
    accelerator.save_state(f"{args.out}/state")
    accelerator.save_model(model, f"{args.out}/model")
    accelerator.print(f"sharded state in {args.out}/state, consolidated model in {args.out}/model")


if __name__ == "__main__":
    main()
