"""Train a small GPT with ZeRO stage 3 on CPU processes, then write the consolidated model.

    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 3 --steps 150

Each rank holds 1/N of the parameters, gradients and AdamW state; the loss goes down as
with single-process training, and the model is consolidated into one safetensors file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.corpus import batches, byte_tokens
from examples.gpt import GPT, GPTConfig, decay_groups
from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", default="runs/gpt")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    with init_on_meta():  # nothing is allocated until the engine materializes its shard
        model = GPT(cfg)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    optimizer = torch.optim.AdamW(decay_groups(model), lr=3e-3, betas=(0.9, 0.95))
    engine = ZeroEngine(
        model,
        optimizer,
        ZeroConfig(stage=args.stage, gradient_clipping=1.0, compute_dtype=args.dtype),
    )
    tokens = byte_tokens()
    if rank == 0:
        print(
            f"GPT {n_params / 1e6:.2f}M parameters, ZeRO stage {args.stage}, {world} ranks, "
            f"corpus {len(tokens) / 1e6:.2f}M bytes"
        )

    per_rank = args.batch // (world * args.accum)
    start = time.perf_counter()
    for step in range(args.steps):
        total = torch.zeros(1)
        for micro in range(args.accum):
            x, y = batches(
                tokens, args.batch // args.accum, cfg.block_size, step * args.accum + micro
            )
            x, y = (
                x[rank * per_rank : (rank + 1) * per_rank],
                y[rank * per_rank : (rank + 1) * per_rank],
            )
            sync = engine.no_sync() if micro < args.accum - 1 else torch.enable_grad()
            with sync:
                loss = engine(x, y) / args.accum
                engine.backward(loss)
            total += loss.detach()
        engine.step()
        engine.zero_grad()
        dist.all_reduce(total)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {total.item() / world:.4f}  "
                f"{(time.perf_counter() - start) / (step + 1):.2f} s/step",
                flush=True,
            )

    report = engine.memory_report()
    line = "  ".join(f"{k} {v / 2**20:.2f}" for k, v in report.items() if v)
    for r in range(world):
        if r == rank:
            print(f"rank {rank} memory (MiB): {line}", flush=True)
        dist.barrier()

    state = engine.full_state_dict()  # gathered one unit at a time, kept on rank 0
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        # Tied weights are stored once (safetensors refuses shared tensors).
        unique = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
        save_file(unique, out / "model.safetensors")
        print(f"consolidated model written to {out / 'model.safetensors'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
