"""One MoE training run of one implementation on one rank; writes a JSON file of figures.

Launched by `benchmarks/moe_bench.py` through torchrun; not meant to be run by hand.
Implementations (all expert-parallel over the 2 ranks, ep_size 2):
- `ds-moe`: DeepSpeed-MoE (`deepspeed.moe.layer.MoE`) under DeepSpeed ZeRO-2, the
  combination its tutorial trains (`DS_ACCELERATOR=cpu`);
- `zero1`, `zero2`, `zero3`: this project's `MoE` under its engine at that stage (stage 3
  is what DeepSpeed refuses with its MoE layers).
Both layers use the same experts (the example GPT's MLP), top-2 routing, capacity factor
1.0 with min capacity 4, and the same balancing-loss coefficient, on the same batches.
- `mixtral-ep2`, `mixtral-ep1`: a small Hugging Face Mixtral (`MIXTRAL`, its own code and
  auxiliary loss) under stage 3, with `expert_parallel_size` 2 (each rank holds 4 of the
  8 experts of every layer) or 1 (every expert sharded by ZeRO-3 over both ranks).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_worker import PeakRSS, finish_rank, init_ranks, worker_arguments
from examples.gpt import GPT, MLP, GPTConfig

# ~40M parameters, 8 experts of 1.6M in each of 4 layers, seq 128.
CFG = GPTConfig(
    vocab_size=8192,
    block_size=128,
    n_layer=4,
    n_head=8,
    n_embd=512,
    tie_embeddings=False,
    n_experts=8,
    ep_size=2,
    moe_k=2,
    moe_capacity_factor=1.0,
)
LR, CLIP = 1e-4, 1.0
# ~27M parameters, 8 experts of 0.4M in each of 4 layers (most of the model), seq 128.
MIXTRAL = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=CFG.block_size,
    output_router_logits=True,
)


class DeepSpeedMoE(nn.Module):
    """DeepSpeed's layer in the example GPT's place: returns only the output, keeping the
    balancing loss for the model to add (as `zero_strategy.moe.MoE` does)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        from deepspeed.moe.layer import MoE as DSMoE

        self.layer = DSMoE(
            hidden_size=cfg.n_embd,
            expert=MLP(cfg.n_embd),
            num_experts=cfg.n_experts,
            ep_size=cfg.ep_size,
            k=cfg.moe_k,
            capacity_factor=cfg.moe_capacity_factor,
            eval_capacity_factor=cfg.moe_capacity_factor,
            min_capacity=4,
            drop_tokens=True,
        )
        self.last_losses = None

    def forward(self, x):
        out, l_aux, _ = self.layer(x)
        self.last_losses = CFG.moe_aux_loss_coef * l_aux
        return out


def build(impl: str):
    """(forward returning the loss, backward, step)."""
    if impl == "ds-moe":
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        torch.manual_seed(0)
        model = GPT(replace(CFG, n_experts=0))
        for block in model.blocks:
            del block.fc, block.out
            block.moe = DeepSpeedMoE(CFG)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"}
        )
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": CLIP,
            "zero_optimization": {
                "stage": 2,
                "contiguous_gradients": True,
                "reduce_scatter": True,
            },
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(groups, lr=LR), config=config
        )

        def forward(x, y):
            loss = engine(x, y)
            return loss + sum(b.moe.last_losses for b in model.blocks)

        return forward, engine.backward, engine.step
    from zero_strategy import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    if impl.startswith("mixtral"):
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(**MIXTRAL))
        config = ZeroConfig(stage=3, gradient_clipping=CLIP, expert_parallel_size=int(impl[-1]))
    else:
        model = GPT(CFG)  # its forward adds the MoE balancing losses
        config = ZeroConfig(stage=int(impl[4]), gradient_clipping=CLIP)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    if impl.startswith("mixtral"):

        def forward(x, y):  # the model shifts the labels and adds its auxiliary loss
            return model(input_ids=x, labels=x).loss

        return forward, engine.backward, lambda: (engine.step(), engine.zero_grad())

    def step():
        engine.step()
        engine.zero_grad()

    return engine, engine.backward, step


def main() -> None:
    args = worker_arguments()
    rank = init_ranks(args.impl)
    forward, backward, step = build(args.impl)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(CFG.vocab_size, (args.batch, CFG.block_size + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    times, losses = [], []
    with PeakRSS() as rss:
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            loss = forward(x, y)
            backward(loss)
            step()
            elapsed = time.perf_counter() - t0
            losses.append(loss.item())
            if i >= args.warmup:
                times.append(elapsed)
    step_s = statistics.median(times)
    result = {
        "impl": args.impl,
        "rank": rank,
        "median_step_s": step_s,
        "tokens_per_s": args.batch * CFG.block_size / step_s,
        "peak_rss_mib": rss.peak / 2**20,
        "losses": losses,
    }
    finish_rank(args.out, args.impl, rank, result)


if __name__ == "__main__":
    main()
