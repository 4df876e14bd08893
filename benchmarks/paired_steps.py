"""Step time of several implementations measured step against step, in one job.

`engine_bench.py` runs each implementation in its own job, one after another; this
machine's speed drifts by 10% within minutes, as much as the differences measured. Here
every implementation is built in the same processes (each its own copy of the same GPT)
and they take turns, one training step each, in an order reversed every turn. Each
ratio compares two steps taken seconds apart, and the figure is the median of those
per-turn ratios. Memory is not measured here (the implementations share the processes):
`engine_bench.py` measures it.

    python benchmarks/paired_steps.py --impls ddp,zero3,zero2 --steps 12

Implementations: those of `engine_worker.py` that run in torch's own process group (ddp,
fsdp2, zero1/2/3, zero3-reuse, -bf16 variants); not DeepSpeed, which initialises its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import torchrun  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks import engine_worker as ew

    rank = ew.init_ranks("ddp")
    cfg = ew.SIZES[args.size]
    runs = {}
    for impl in args.impls:
        model, n_params = ew.make_model(impl, cfg)
        runs[impl] = ew.build(impl, model)
    data = torch.randint(
        cfg.vocab_size,
        (args.batch, cfg.block_size + 1),
        generator=torch.Generator().manual_seed(rank),
    )
    x, y = data[:, :-1], data[:, 1:]
    wall = {impl: [] for impl in args.impls}
    cpu = {impl: [] for impl in args.impls}
    phases = {impl: [] for impl in args.impls}
    losses = {impl: [] for impl in args.impls}
    for turn in range(args.warmup + args.steps):
        order = args.impls if turn % 2 == 0 else args.impls[::-1]
        for impl in order:
            forward, backward, step, _ = runs[impl]
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = forward(x, y)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            step()
            t3, c3 = time.perf_counter(), time.process_time()
            losses[impl].append(loss.item())
            if turn >= args.warmup:
                wall[impl].append(t3 - t0)
                cpu[impl].append(c3 - c0)  # this process, every thread (gloo's too)
                phases[impl].append((t1 - t0, t2 - t1, t3 - t2))
    # The slower rank decides a step: take each turn's maximum over ranks.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"wall": wall, "cpu": cpu, "phases": phases})
    if rank == 0:
        result = {
            "params": n_params,
            "ranks": dist.get_world_size(),
            "impls": args.impls,
            "wall": {
                i: [max(r["wall"][i][k] for r in everyone) for k in range(args.steps)]
                for i in args.impls
            },
            "cpu": {
                i: [statistics.mean(r["cpu"][i][k] for r in everyone) for k in range(args.steps)]
                for i in args.impls
            },
            "phases": {
                i: [statistics.median(p[j] for p in phases[i]) for j in range(3)]
                for i in args.impls
            },
            "losses": losses,
        }
        Path(args.out).write_text(json.dumps(result))
    for impl in args.impls:
        engine = runs[impl][0]
        if hasattr(engine, "close"):
            engine.close()
    dist.barrier()
    dist.destroy_process_group()


def table(result: dict, size: str, batch: int) -> str:
    impls, wall = result["impls"], result["wall"]
    base = impls[0]
    lines = [
        f"GPT {result['params'] / 1e6:.1f}M params ({size}), {result['ranks']} ranks gloo, 1 thread/rank, "
        f"batch {batch}/rank, {len(wall[base])} turns; each impl one step per turn",
        f"| impl | median step (s) | throughput vs {base} (median of per-turn ratios) | "
        "range of per-turn ratios | CPU s/step/rank | phases fwd/bwd/step (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for impl in impls:
        ratios = [b / t for b, t in zip(wall[base], wall[impl], strict=True)]
        phases = "/".join(f"{p * 1000:.0f}" for p in result["phases"][impl])
        lines.append(
            f"| {impl} | {statistics.median(wall[impl]):.3f} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f} | {statistics.median(result['cpu'][impl]):.3f} | "
            f"{phases} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default="ddp,zero3,zero2", help="the first is the baseline")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.impls = args.impls.split(",")
    if args.worker:
        worker(args)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "result.json"))
        passed = [f"--{k}={getattr(args, k)}" for k in ("size", "batch", "warmup", "steps")]
        proc = torchrun(
            __file__,
            "--worker",
            f"--impls={','.join(args.impls)}",
            *passed,
            f"--out={out}",
            nproc=args.nproc,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the job failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(Path(out).read_text())
    print(table(result, args.size, args.batch))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
