"""One model of `benchmarks/moe_claims.py` trained on one rank of 2; writes a JSON file of
figures. Launched through torchrun by the driver; not meant to be run by hand.

Every model trains the same tokens (the standard library's docstrings as bytes, the
last 5% held out for validation) with the same AdamW settings, at ZeRO stage 1 with
expert parallelism over both ranks for the MoE models:
- `dense`: the base GPT; `dense4x`: about 4x its parameters (the quality reference);
- `moe`: the base with 8 experts in every layer, top-1 (DeepSpeed-MoE's gating);
- `prmoe`: pyramid-residual MoE, 2-2-4-8 experts, top-1 plus a dense MLP in each layer;
- `mos`: a 3-layer PR-MoE student distilled from the trained `prmoe` (read from
  `--teacher`), distillation stopped halfway.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_worker import PeakRSS, finish_rank, init_ranks, worker_arguments
from examples.corpus import byte_tokens
from examples.gpt import GPT, GPTConfig
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.moe import moe_losses
from zero_strategy.moe.distillation import Distillation

BASE = GPTConfig(
    vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128, tie_embeddings=True
)
MODELS = {
    "dense": BASE,
    "dense4x": replace(BASE, n_embd=256, n_head=8),
    "moe": replace(BASE, layers="4*moe:8", moe_k=1, ep_size=None),
    "prmoe": replace(BASE, layers="2*residual:2 residual:4 residual:8", moe_k=1, ep_size=None),
    "mos": replace(
        BASE, n_layer=3, layers="residual:2 residual:4 residual:8", moe_k=1, ep_size=None
    ),
}
LR, BATCH, KD_WEIGHT, KD_STOP = 2e-3, 16, 1.0, 0.5


def parameters(model: GPT, cfg: GPTConfig) -> tuple[int, int]:
    """(total, active per token) of the whole model, every expert counted once in the
    total and k of each layer's experts in the active count. Call before sharding."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    active = total
    for block in model.blocks:
        if hasattr(block, "moe"):
            per_expert = (
                sum(p.numel() for p in block.moe.experts.parameters()) // block.moe.num_local
            )
            active -= per_expert * (block.moe.num_experts - cfg.moe_k)
    return total, active


def main() -> None:
    args = worker_arguments(
        ("--train-steps", {"type": int, "default": 300}),
        ("--eval-every", {"type": int, "default": 50}),
        ("--teacher", {"default": ""}),
    )
    rank = init_ranks(args.impl)
    world = dist.get_world_size()
    cfg = MODELS[args.impl]
    tokens = byte_tokens()
    cut = int(len(tokens) * 0.95)
    train, held_out = tokens[:cut], tokens[cut:]
    torch.manual_seed(0)
    student = GPT(cfg)
    total, active = parameters(student, cfg)
    model = student
    if args.impl == "mos":
        from safetensors.torch import load_file

        torch.manual_seed(1)
        teacher = GPT(MODELS["prmoe"])
        teacher.load_state_dict(load_file(args.teacher))
        model = Distillation(student, teacher, KD_WEIGHT, 1.0, int(KD_STOP * args.train_steps))
    optimizer = torch.optim.AdamW(student.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    experts = cfg.layers is not None
    engine = ZeroEngine(
        model,
        optimizer,
        ZeroConfig(stage=1, gradient_clipping=1.0, expert_parallel_size=world if experts else 1),
    )
    per_rank = BATCH // world
    flops_per_token = 6 * active  # forward and backward through the active parameters

    def validation_loss() -> float:
        student.eval()
        g = torch.Generator().manual_seed(7)
        total_loss = torch.zeros(())
        with torch.no_grad():
            for _ in range(4):
                starts = torch.randint(len(held_out) - cfg.block_size - 1, (BATCH,), generator=g)
                data = torch.stack([held_out[s : s + cfg.block_size + 1] for s in starts.tolist()])
                part = data[rank * per_rank : (rank + 1) * per_rank]
                logits = student(part[:, :-1])
                total_loss += F.cross_entropy(logits.reshape(-1, 256), part[:, 1:].reshape(-1))
        dist.all_reduce(total_loss)
        student.train()
        return total_loss.item() / (4 * world)

    curve, train_time = [], 0.0
    g = torch.Generator().manual_seed(0)
    with PeakRSS() as rss:
        for step in range(args.train_steps + 1):
            if step % args.eval_every == 0 or step == args.train_steps:
                tokens_seen = step * BATCH * cfg.block_size
                curve.append(
                    {
                        "step": step,
                        "time_s": train_time,
                        "flops": flops_per_token * tokens_seen,
                        "val_loss": validation_loss(),
                    }
                )
            if step == args.train_steps:
                break
            starts = torch.randint(len(train) - cfg.block_size - 1, (BATCH,), generator=g)
            data = torch.stack([train[s : s + cfg.block_size + 1] for s in starts.tolist()])
            x, y = (
                data[rank * per_rank : (rank + 1) * per_rank, :-1],
                data[rank * per_rank : (rank + 1) * per_rank, 1:],
            )
            dist.barrier()
            t0 = time.perf_counter()
            teacher_logits = None
            if args.impl == "mos" and model.active(step):
                teacher_logits = model.teacher_logits(x)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)) + moe_losses(student)
            if args.impl == "mos":
                loss = loss + model.loss(logits, teacher_logits, step)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            train_time += time.perf_counter() - t0
    latency = {}
    student.eval()
    for batch in (1, 8):
        prompt = held_out[: 16 * batch].reshape(batch, 16)
        student.generate(prompt, 4)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        new = 32
        student.generate(prompt, new)
        latency[str(batch)] = (time.perf_counter() - t0) / new * 1e3
    if args.impl == "prmoe":  # the MoS teacher; every rank takes part in the gathers
        from safetensors.torch import save_file

        state = engine.full_state_dict()
        if rank == 0:
            tensors = {k: v.clone() for k, v in state.items()}  # tied weights: stored apart
            save_file(tensors, str(Path(args.out, "prmoe.safetensors")))
    result = {
        "impl": args.impl,
        "rank": rank,
        "params_total": total,
        "params_active": active,
        "curve": curve,
        "tokens_per_s": args.train_steps * BATCH * cfg.block_size / train_time,
        "peak_rss_mib": rss.peak / 2**20,
        "latency_ms_per_token": latency,
    }
    finish_rank(args.out, args.impl, rank, result)


if __name__ == "__main__":
    main()
