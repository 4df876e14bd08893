"""Side by side on the same GPT: DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and this engine's
stages 1/2/3, 2 ranks, gloo, one thread per rank, fp32, clipping 1.0 everywhere.

    python benchmarks/engine_bench.py --rounds 3            # ~82M parameters
    python benchmarks/engine_bench.py --size big --rounds 1  # ~730M: stage 3, FSDP2, ds3,
                                                             # fp32 and bf16 (DDP cannot fit)
    python benchmarks/engine_bench.py --size tiny --rounds 1  # a quick smoke run
    python benchmarks/engine_bench.py --impls tp --nproc 4   # dp 2 x tp 2: ours vs FSDP2+TP

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
# dp x tp 2 on 4 ranks (--nproc 4): ours at stages 1 and 3 and FSDP2 + tensor parallel
# (ModelParallelStrategy's recipe), on a Llama of the GPT's width and depth.
TENSOR_PARALLEL = ["fsdp2-tp2", "zero1-tp2", "zero3-tp2"]
# The ~0.7B model: stage 3 and its peers, fp32 and bf16 compute, at batch 1.
BIG = ["ddp", "fsdp2", "ds3", "ds3-lean", "zero3", "fsdp2-bf16", "zero3-bf16"]
# torch.compile (--impls compiled): each compiled beside its eager run; DDP compiled whole,
# FSDP2 and ours per block. The first step (compilation) is reported apart.
COMPILED = [
    f"{impl}{c}" for impl in ("ddp", "fsdp2", "zero1", "zero2", "zero3") for c in ("", "-compiled")
]
BATCH = {"big": 1}  # sequences per rank; 4 for the other sizes


def skip_reason(impl: str, args) -> str | None:
    """Why `impl` cannot run at this size here, from the planner, or None. Only DDP (the
    whole model state on every rank) is checked: it is the one that cannot shard."""
    if impl != "ddp":
        return None
    import psutil
    import torch

    from benchmarks.engine_worker import SIZES
    from examples.gpt import GPT
    from zero_strategy.memory.planner import plan

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(SIZES[args.size]).parameters())
    available = psutil.virtual_memory().available
    need = plan(params, args.nproc, 0).model_state
    if need * args.nproc <= 0.9 * available:
        return None
    return (
        f"DDP holds the whole model state on every rank: {need / 1e9:.1f} GB per rank "
        f"(planner, {params / 1e6:.0f}M parameters, fp32 AdamW), {need * args.nproc / 1e9:.1f}"
        f" GB for {args.nproc} ranks, more than 90% of the {available / 1e9:.1f} GB this "
        "machine has available (the rest goes to the processes, activations and buffers)"
    )


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
        "--batch",
        str(args.batch),
        *(["--layers", str(args.layers)] if getattr(args, "layers", 0) else []),
        *(["--meta"] if getattr(args, "meta", False) else []),
        nproc=args.nproc,
        timeout=args.timeout,
        failures=args.skipped,
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
        "first": max(r["first_step_s"] for r in ranks),
        "io_read": max(r["io_read_per_step"] for r in ranks),
        "io_write": max(r["io_write_per_step"] for r in ranks),
    }


def run_rounds(impls: list[str], args) -> list[dict[str, dict]]:
    for impl in list(impls):
        reason = skip_reason(impl, args)
        if reason:
            print(f"skipped {impl}: {reason}", flush=True)
            args.skipped[impl] = reason
            impls.remove(impl)
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


def _median_ratio(rounds, num: str, den: str, key: str = "step") -> str:
    ratios = [rd[num][key] / rd[den][key] for rd in rounds if num in rd and den in rd]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _fsdp_peer(impl: str) -> str | None:
    """FSDP2 in the same compute dtype (and the same tensor parallelism), for this
    engine's rows."""
    if not impl.startswith("zero"):
        return None
    if impl.endswith("-tp2"):
        return "fsdp2-tp2"
    return "fsdp2-bf16" if impl.endswith("-bf16") else "fsdp2"


def print_table(impls: list[str], rounds: list[dict[str, dict]], args) -> None:
    """Median step time; per-round ratios (then their median): throughput against DDP and
    against DeepSpeed at the same stage, step time and peak RSS against FSDP2 in the same
    dtype; peak RSS and model state per rank."""
    import os

    params = next(iter(rounds[0].values()))["params"] if rounds and rounds[0] else 0
    model = "Llama (dp x tp 2)" if all(i.endswith("-tp2") for i in impls) else "GPT"
    print(
        f"\n{model} {params / 1e6:.1f}M params, {args.nproc} ranks gloo, 1 thread/rank "
        f"({os.cpu_count()} cores here), batch {args.batch}/rank, {len(rounds)} rounds "
        f"x {args.steps} timed steps"
    )
    for impl, reason in getattr(args, "skipped", {}).items():
        print(f"{impl}: no figures: {reason}.")
    print(
        "| impl | median step (s) | throughput vs DDP | vs DeepSpeed same stage "
        "| step time / FSDP2's | peak RSS/rank (MiB) | peak RSS / FSDP2's "
        "| model state/rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for impl in impls:
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            continue
        peer = "ds" + impl[4] if impl.startswith("zero") and "bf16" not in impl else None
        if peer == "ds3" and not any("ds3" in rd for rd in rounds):
            peer = "ds3-lean"  # DeepSpeed's defaults did not fit: its tuned run
        vs_ds = _median_ratio(rounds, peer, impl) if peer else "-"
        fsdp = _fsdp_peer(impl)
        time_vs_fsdp = _median_ratio(rounds, impl, fsdp) if fsdp else "-"
        rss_vs_fsdp = _median_ratio(rounds, impl, fsdp, "rss") if fsdp else "-"
        print(
            f"| {impl} | {statistics.median(g['step'] for g in got):.3f} "
            f"| {_median_ratio(rounds, 'ddp', impl)} | {vs_ds} | {time_vs_fsdp} "
            f"| {statistics.median(g['rss'] for g in got):.0f} | {rss_vs_fsdp} "
            f"| {got[0]['state']:.1f} |"
        )


def print_compiled_table(impls: list[str], rounds: list[dict[str, dict]]) -> None:
    """Compiled rows against their eager run and against compiled DDP (per-round ratios,
    then their median), with the first step's time apart: it compiles."""
    print(
        "\n| compiled | median step (s) | step time / eager's | throughput vs DDP compiled "
        "| first step (s, compiling) | eager first step (s) |"
    )
    print("|---|---|---|---|---|---|")
    for impl in impls:
        if not impl.endswith("-compiled"):
            continue
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            continue
        eager = impl.removesuffix("-compiled")
        eager_first = [rd[eager]["first"] for rd in rounds if eager in rd]
        eager_first_s = f"{statistics.median(eager_first):.1f}" if eager_first else "-"
        print(
            f"| {impl} | {statistics.median(g['step'] for g in got):.3f} "
            f"| {_median_ratio(rounds, impl, eager)} "
            f"| {_median_ratio(rounds, 'ddp-compiled', impl)} "
            f"| {statistics.median(g['first'] for g in got):.1f} | {eager_first_s} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--impls",
        default="",
        help=(
            f"default: {ALL}; for --size big {BIG}; 'tp' for {TENSOR_PARALLEL} (--nproc 4); "
            f"'compiled' for {COMPILED}"
        ),
    )
    parser.add_argument("--batch", type=int, default=0, help="default: 1 for big, else 4")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one core each)")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="", help="also write all figures here")
    parser.add_argument("--from-json", default="", help="print the table of a saved run")
    args = parser.parse_args()
    impls = args.impls.split(",") if args.impls else (BIG if args.size == "big" else ALL)
    if impls == ["tp"]:
        impls = list(TENSOR_PARALLEL)
    if impls == ["compiled"]:
        impls = list(COMPILED)
    args.batch = args.batch or BATCH.get(args.size, 4)
    args.skipped = {}
    if args.from_json:
        rounds = json.loads(Path(args.from_json).read_text())
        skipped = Path(args.from_json).with_suffix(".skipped.json")
        if skipped.exists():
            args.skipped = json.loads(skipped.read_text())
    else:
        rounds = run_rounds(impls, args)
    print_table(impls, rounds, args)
    if any(i.endswith("-compiled") for i in impls):
        print_compiled_table(impls, rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
        Path(args.json).with_suffix(".skipped.json").write_text(json.dumps(args.skipped))


if __name__ == "__main__":
    main()
