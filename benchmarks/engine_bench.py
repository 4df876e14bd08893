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
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import interleaved_rounds, run_ranks  # noqa: E402

ALL = ["ddp", "fsdp2", "ds1", "ds2", "ds3", "zero1", "zero2", "zero3", "zero3-reuse"]


def run_one(impl: str, args, out: str) -> dict | None:
    ranks = run_ranks(
        str(HERE / "engine_worker.py"),
        impl,
        out,
        "--size",
        args.size,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        timeout=args.timeout,
    )
    if ranks is None:
        return None
    return {
        "step": max(r["median_step_s"] for r in ranks),
        "phases": ranks[0]["phase_medians_s"],
        "rss": max(r["peak_rss_mib"] for r in ranks),
        "state": max(r["model_state_mib"] for r in ranks),
        "loss": ranks[0]["losses"],
        "params": ranks[0]["params"],
    }


def run_rounds(impls: list[str], args) -> list[dict[str, dict]]:
    return interleaved_rounds(
        impls,
        args.rounds,
        lambda impl, out: run_one(impl, args, out),
        lambda res: (
            f"step {res['step']:.3f}s rss {res['rss']:.0f} MiB state {res['state']:.1f} MiB "
            f"loss {res['loss'][-1]:.5f} phases "
            + "/".join(f"{v * 1000:.0f}" for v in res["phases"].values())
        ),
    )


def _median_ratio(rounds, num: str, den: str) -> float:
    ratios = [rd[num]["step"] / rd[den]["step"] for rd in rounds if num in rd and den in rd]
    return statistics.median(ratios) if ratios else float("nan")


def print_table(impls: list[str], rounds: list[dict[str, dict]], args) -> None:
    """Median step time; throughput ratios per round (then the median) against DDP and
    against DeepSpeed at the same stage; peak RSS and model state per rank."""
    params = next(iter(rounds[0].values()))["params"] if rounds and rounds[0] else 0
    print(
        f"\nGPT {params / 1e6:.1f}M params, 2 ranks gloo, 1 thread/rank, {len(rounds)} rounds "
        f"x {args.steps} timed steps"
    )
    print(
        "| impl | median step (s) | throughput vs DDP | vs DeepSpeed same stage "
        "| peak RSS/rank (MiB) | model state/rank (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for impl in impls:
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            continue
        peer = "ds" + impl[4] if impl.startswith("zero") else None
        vs_ds = f"{_median_ratio(rounds, peer, impl):.2f}x" if peer else "-"
        print(
            f"| {impl} | {statistics.median(g['step'] for g in got):.3f} "
            f"| {_median_ratio(rounds, 'ddp', impl):.2f}x | {vs_ds} "
            f"| {statistics.median(g['rss'] for g in got):.0f} | {got[0]['state']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", default=",".join(ALL))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="", help="also write all figures here")
    parser.add_argument("--from-json", default="", help="print the table of a saved run")
    args = parser.parse_args()
    impls = args.impls.split(",")
    if args.from_json:
        rounds = json.loads(Path(args.from_json).read_text())
    else:
        rounds = run_rounds(impls, args)
    print_table(impls, rounds, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
