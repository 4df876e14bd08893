"""Side by side on the same GPT: DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and this engine's
stages 1/2/3, 2 ranks, gloo, one thread per rank, fp32, clipping 1.0 everywhere.

    python benchmarks/engine_bench.py --rounds 3            # ~82M parameters
    python benchmarks/engine_bench.py --size tiny --rounds 1  # a quick smoke run

The configurations run interleaved (a different order each round) because this machine
is noisy; each round's step times are divided by that round's DDP time and the table shows
median ratios. Peak RSS is the larger rank's, sampled every 5 ms during the steps.
Model state is the bytes of parameters, gradients, optimizer state and masters per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL = ["ddp", "fsdp2", "ds1", "ds2", "ds3", "zero1", "zero2", "zero3"]


def run_one(impl: str, args, out: str) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "engine_worker.py"),
        "--impl",
        impl,
        "--size",
        args.size,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--out",
        out,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        print(f"  {impl}: failed (rc={proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    ranks = [json.loads(Path(out, f"{impl}.rank{r}.json").read_text()) for r in range(2)]
    return {
        "step": max(r["median_step_s"] for r in ranks),
        "phases": ranks[0]["phase_medians_s"],
        "rss": max(r["peak_rss_mib"] for r in ranks),
        "state": max(r["model_state_mib"] for r in ranks),
        "loss": ranks[0]["losses"],
        "params": ranks[0]["params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", default=",".join(ALL))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="", help="also write all figures here")
    args = parser.parse_args()
    impls = args.impls.split(",")
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            order = impls[r % len(impls) :] + impls[: r % len(impls)]
            if r % 2:
                order.reverse()
            results = {}
            for impl in order:
                res = run_one(impl, args, out)
                if res:
                    results[impl] = res
                    print(
                        f"round {r} {impl:6s} step {res['step']:.3f}s rss {res['rss']:.0f} MiB "
                        f"state {res['state']:.1f} MiB loss {res['loss'][-1]:.5f} phases "
                        + "/".join(f"{v * 1000:.0f}" for v in res["phases"].values()),
                        flush=True,
                    )
            rounds.append(results)
    rows = []
    for impl in impls:
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            continue
        ratios = [
            rd["ddp"]["step"] / rd[impl]["step"] for rd in rounds if impl in rd and "ddp" in rd
        ]
        rows.append(
            (
                impl,
                statistics.median(g["step"] for g in got),
                statistics.median(ratios) if ratios else float("nan"),
                statistics.median(g["rss"] for g in got),
                got[0]["state"],
            )
        )
    params = next(iter(rounds[0].values()))["params"] if rounds and rounds[0] else 0
    print(
        f"\nGPT {params / 1e6:.1f}M params, 2 ranks gloo, 1 thread/rank, {args.rounds} rounds "
        f"x {args.steps} timed steps"
    )
    print(
        "| impl | median step (s) | throughput vs DDP | peak RSS/rank (MiB) | model state/rank (MiB) |"
    )
    print("|---|---|---|---|---|")
    for impl, step, ratio, rss, state in rows:
        print(f"| {impl} | {step:.3f} | {ratio:.2f}x | {rss:.0f} | {state:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
