"""One rank of one row of `benchmarks/two_nodes_bench.py`, under torchrun in one of the
two network namespaces of `scripts/two_nodes.py`; writes a JSON file of figures.

Rows: zero3 (plain stage 3), zero3-hier (secondary_partition_size = ranks per node),
zero3-hier-int8 (and int8 weights and gradients over the link), zero3-int8 (int8
without the hierarchy), fsdp2-hsdp (FSDP2 on a (replicate, shard) mesh: sharded within
the node, replicated across), ds3-zeropp (DeepSpeed ZeRO-3 with ZeRO++'s three parts;
DeepSpeed 0.19.8 refuses its quantizer on the CPU) and ds3-hpz (ZeRO++'s hpZ alone).
Every row trains the same GPT on the same batches with AdamW and clipping at 1.0.

Bytes over the link are read from the node's end of the veth (what the kernel sent and
received on it, TCP included), by each node's first rank around each timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from engine_worker import (  # noqa: E402
    CLIP,
    LR,
    SIZES,
    init_ranks,
    plain_torch_step_and_state,
)

from examples.gpt import GPT  # noqa: E402

ZERO_ROWS = {
    "zero3": {},
    "zero3-hier": {"secondary_partition_size": "node"},
    "zero3-hier-int8": {
        "secondary_partition_size": "node",
        "quantized_weights": True,
        "quantized_gradients": True,
    },
    "zero3-int8": {"quantized_weights": True, "quantized_gradients": True},
}


def link_bytes() -> int:
    """Bytes sent plus received on this node's end of the link."""
    net = Path("/sys/class/net", os.environ["GLOO_SOCKET_IFNAME"], "statistics")
    return sum(int((net / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


def build(row: str, model: torch.nn.Module, per_node: int):
    """(forward, backward, step, across-node bytes counted by the engine or None)."""
    if row in ZERO_ROWS:
        from zero_strategy import ZeroConfig, ZeroEngine

        extra = {k: per_node if v == "node" else v for k, v in ZERO_ROWS[row].items()}
        engine = ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR),
            ZeroConfig(stage=3, gradient_clipping=CLIP, **extra),
        )

        def step():
            engine.step()
            engine.zero_grad()

        def counted() -> int:
            report = engine.comm_report()
            engine.reset_comm_report()
            return sum(v["across_node_bytes"] for k, v in report.items() if k != "control")

        return engine, engine.backward, step, counted
    if row == "fsdp2-hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        runner = fully_shard(model, mesh=mesh)
        step, _ = plain_torch_step_and_state(model)
        return runner, lambda loss: loss.backward(), step, None
    if row in ("ds3-zeropp", "ds3-hpz"):
        import deepspeed

        zero = {"stage": 3, "zero_hpz_partition_size": per_node}
        if row == "ds3-zeropp":  # its quantizer ops are CUDA-only: refused on the CPU
            zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": CLIP,
            "zero_optimization": zero,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config
        )
        return engine, engine.backward, engine.step, None
    raise SystemExit(f"unknown row {row}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", default="bench", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    rank, world = init_ranks(args.row), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    first_of_node = int(os.environ["LOCAL_RANK"]) == 0
    try:
        cfg = SIZES[args.size]
        torch.manual_seed(0)
        model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())  # before any sharding
        forward, backward, step, counted = build(args.row, model, per_node)
        g = torch.Generator().manual_seed(rank)
        times, wire, engine_bytes, losses = [], [], [], []
        for i in range(args.warmup + args.steps):
            data = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
            dist.barrier()
            if counted is not None:
                counted()  # from here
            before = link_bytes() if first_of_node else 0
            t0 = time.perf_counter()
            loss = forward(data[:, :-1], data[:, 1:])
            backward(loss)
            step()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if i >= args.warmup:
                times.append(elapsed)
                wire.append(link_bytes() - before if first_of_node else 0)
                if counted is not None:
                    engine_bytes.append(counted())
        result = {
            "row": args.row,
            "rank": rank,
            "world": world,
            "per_node": per_node,
            "params": params,
            "link": os.environ.get("ZERO_NODE_LINK", ""),
            "step_times": times,
            "median_step_s": statistics.median(times),
            "node_link_bytes_per_step": statistics.median(wire) if first_of_node else None,
            "engine_across_bytes_per_step": (
                statistics.median(engine_bytes) if engine_bytes else None
            ),
            "losses": losses,
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"{args.row}.rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
