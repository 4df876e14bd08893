"""DeepSpeed-MoE's three claims, measured at this project's small scale: one script, 2 CPU
ranks, the standard library's docstrings as the corpus (no download), the same tokens and
AdamW settings for every model.

    python benchmarks/moe_claims.py --train-steps 300    # needs pip install -e .[bench]

Models: a dense base, a dense model of about 4x its parameters (the quality reference),
MoE (8 experts per layer, top-1), PR-MoE (2-2-4-8 residual experts) and a 3-layer
PR-MoE student distilled from the trained PR-MoE (Mixture-of-Students). For each: the
validation loss (and its curve against training time and FLOPs), training tokens/s,
total and active parameters, peak RSS per rank, and generation latency per token at
batch 1 and 8. Then, for each claim, what this run shows:
- MoE reaches the dense reference's quality at less training cost (time, FLOPs);
- PR-MoE keeps MoE's quality with fewer parameters; the student keeps the teacher's;
- MoE serves faster than the dense model of equal quality.
A claim this scale does not reproduce is reported as the figure, not the claim.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import run_ranks  # noqa: E402

ORDER = ["dense", "dense4x", "moe", "prmoe", "mos"]  # the student needs the trained PR-MoE


def run(impl: str, args, out: str) -> dict | None:
    extra = ["--teacher", str(Path(out, "prmoe.safetensors"))] if impl == "mos" else []
    ranks = run_ranks(
        str(HERE / "moe_claims_worker.py"),
        impl,
        out,
        "--train-steps",
        str(args.train_steps),
        "--eval-every",
        str(args.eval_every),
        *extra,
        timeout=args.timeout,
    )
    if ranks is None:
        return None
    first = ranks[0]
    first["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    first["tokens_per_s"] = min(r["tokens_per_s"] for r in ranks)
    first["latency_ms_per_token"] = {
        b: max(r["latency_ms_per_token"][b] for r in ranks) for b in first["latency_ms_per_token"]
    }
    return first


def reach(curve: list[dict], target: float, key: str) -> float | None:
    """The `key` (time_s, flops) at which the validation loss first reaches `target`,
    interpolated between evaluations; None if it never does."""
    for before, after in itertools.pairwise(curve):
        if after["val_loss"] <= target:
            if before["val_loss"] <= target:
                return before[key]
            f = (before["val_loss"] - target) / (before["val_loss"] - after["val_loss"])
            return before[key] + f * (after[key] - before[key])
    return None


def claims(results: dict[str, dict]) -> list[str]:
    lines = []
    final = {k: r["curve"][-1]["val_loss"] for k, r in results.items()}
    if "dense4x" in results and "moe" in results:
        target = final["dense4x"]
        for key, unit in (("time_s", "s"), ("flops", "FLOPs")):
            moe, dense = (
                reach(results["moe"]["curve"], target, key),
                results["dense4x"]["curve"][-1][key],
            )
            if moe is None:
                lines.append(
                    f"Training cost ({unit}): MoE did not reach the dense reference's validation "
                    f"loss {target:.4f} (it ended at {final['moe']:.4f}); the claim is not shown here."
                )
            else:
                lines.append(
                    f"Training cost ({unit}): MoE reached the dense reference's loss {target:.4f} "
                    f"at {moe:.3g} {unit} against the reference's {dense:.3g}: {dense / moe:.2f}x "
                    "cheaper."
                )
    if "moe" in results and "prmoe" in results:
        p, m = results["prmoe"], results["moe"]
        lines.append(
            f"PR-MoE vs MoE: {p['params_total'] / 1e6:.2f}M vs {m['params_total'] / 1e6:.2f}M "
            f"parameters ({m['params_total'] / p['params_total']:.2f}x fewer), validation loss "
            f"{final['prmoe']:.4f} vs {final['moe']:.4f}."
        )
    if "prmoe" in results and "mos" in results:
        s, t = results["mos"], results["prmoe"]
        lines.append(
            f"Student vs teacher (PR-MoE): {s['params_total'] / 1e6:.2f}M vs "
            f"{t['params_total'] / 1e6:.2f}M parameters ({t['params_total'] / s['params_total']:.2f}x "
            f"fewer), validation loss {final['mos']:.4f} vs {final['prmoe']:.4f}."
        )
    if "moe" in results and "dense4x" in results:
        for batch in ("1", "8"):
            moe = results["moe"]["latency_ms_per_token"][batch]
            dense = results["dense4x"]["latency_ms_per_token"][batch]
            lines.append(
                f"Latency at batch {batch}: MoE {moe:.2f} ms/token vs dense reference {dense:.2f} "
                f"({dense / moe:.2f}x); validation loss {final['moe']:.4f} vs {final['dense4x']:.4f}."
            )
    return lines


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, r in results.items():
        for ax, key in zip(axes, ("time_s", "flops")):
            ax.plot([c[key] for c in r["curve"]], [c["val_loss"] for c in r["curve"]], label=impl)
    axes[0].set_xlabel("training time per rank (s)")
    axes[1].set_xlabel("training FLOPs (6 x active parameters x tokens)")
    for ax in axes:
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.suptitle("DeepSpeed-MoE claims at small scale: 2 CPU ranks, stdlib docstrings")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    # RSS should follow what is allocated: routed-token buffers change size every step,
    # and with glibc's growing mmap threshold they fragment its heap (measured: the MoE
    # rows' RSS grew 1-4 MB per step while the live tensors stayed the same).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--impls", default=",".join(ORDER))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default="benchmarks/results/moe_claims")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        for impl in args.impls.split(","):
            r = run(impl, args, work)
            if r is None:
                continue
            results[impl] = r
            print(
                f"{impl:8s} val {r['curve'][-1]['val_loss']:.4f} "
                f"{r['tokens_per_s']:.0f} tokens/s rss {r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    print(f"\n{args.train_steps} steps x 16 sequences x 128 bytes, 2 gloo ranks, stage 1")
    print(
        "| model | params total | active/token | val loss | tokens/s | peak RSS/rank (MiB) "
        "| ms/token b1 | ms/token b8 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for impl, r in results.items():
        lat = r["latency_ms_per_token"]
        print(
            f"| {impl} | {r['params_total'] / 1e6:.2f}M | {r['params_active'] / 1e6:.2f}M "
            f"| {r['curve'][-1]['val_loss']:.4f} | {r['tokens_per_s']:.0f} "
            f"| {r['peak_rss_mib']:.0f} | {lat['1']:.2f} | {lat['8']:.2f} |"
        )
    print()
    for line in claims(results):
        print("-", line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
