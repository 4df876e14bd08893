"""MoE training side by side: this project's expert-parallel `MoE` under ZeRO stages 1-3
against DeepSpeed-MoE under DeepSpeed ZeRO-2, 2 gloo ranks, ep_size 2, one thread per
rank, the same experts, k, capacity and batches; and a small Hugging Face Mixtral under
stage 3 with expert_parallel_size 2 against the same model with every expert sharded by
ZeRO-3 (expert_parallel_size 1).

    python benchmarks/moe_bench.py --rounds 3        # needs pip install -e .[bench]

Runs interleave (a different order each round; the machine is noisy). The table shows
median tokens per second per rank, the ratio to the row's baseline (DeepSpeed-MoE, or
Mixtral at expert_parallel_size 1) measured in the same round (median over rounds), and
peak RSS per rank (the larger rank's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import interleaved_rounds, run_ranks  # noqa: E402

ALL = ["ds-moe", "zero1", "zero2", "zero3", "mixtral-ep1", "mixtral-ep2"]
BASELINE = {"mixtral-ep1": "mixtral-ep1", "mixtral-ep2": "mixtral-ep1"}  # others: ds-moe


def run_one(impl: str, args, out: str) -> dict | None:
    ranks = run_ranks(
        str(HERE / "moe_worker.py"),
        impl,
        out,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        timeout=args.timeout,
    )
    if ranks is None:
        return None
    return {
        "tokens_per_s": min(r["tokens_per_s"] for r in ranks),
        "rss": max(r["peak_rss_mib"] for r in ranks),
        "loss": ranks[0]["losses"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", default=",".join(ALL))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    impls = args.impls.split(",")
    rounds = interleaved_rounds(
        impls,
        args.rounds,
        lambda impl, out: run_one(impl, args, out),
        lambda res: (
            f"{res['tokens_per_s']:.0f} tokens/s rss {res['rss']:.0f} MiB "
            f"loss {res['loss'][-1]:.4f}"
        ),
    )
    print(f"\nep_size 2 on 2 gloo ranks, {len(rounds)} rounds x {args.steps} steps")
    print("| impl | tokens/s per rank | vs baseline (same round) | peak RSS/rank (MiB) |")
    print("|---|---|---|---|")
    for impl in impls:
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            print(f"| {impl} | failed | - | - |")
            continue
        base = BASELINE.get(impl, "ds-moe")
        ratios = [
            rd[impl]["tokens_per_s"] / rd[base]["tokens_per_s"]
            for rd in rounds
            if impl in rd and base in rd
        ]
        ratio = f"{statistics.median(ratios):.2f}x {base}" if ratios else "-"
        print(
            f"| {impl} | {statistics.median(g['tokens_per_s'] for g in got):.0f} | {ratio} "
            f"| {statistics.median(g['rss'] for g in got):.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
