"""Stage 3 across two nodes on a slow link: plain, hierarchical (secondary partition),
hierarchical + int8, and the peers (FSDP2 HSDP, DeepSpeed ZeRO++), at each link rate.

    python benchmarks/two_nodes_bench.py                       # 82M GPT, 1 and 10 Gbit/s
    python benchmarks/two_nodes_bench.py --rates 1gbit --size small --steps 2
    python benchmarks/two_nodes_bench.py --from-json a.json b.json   # one report of both

Each row runs under `scripts/two_nodes.py` (two network namespaces joined by a veth
pair shaped by tc; needs root), 2 nodes x `--per-node` ranks, one thread per rank. Writes
benchmarks/results/two_nodes_<date>.{md,json} and a plot of step time against the link's
rate (two_nodes_<date>.png, with matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import two_nodes  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "two_nodes_worker.py")
ROWS = [
    "zero3",
    "zero3-hier",
    "zero3-hier-int8",
    "zero3-int8",
    "fsdp2-hsdp",
    "ds3-hpz",
    "ds3-zeropp",
]


def gbit(rate: str) -> float:
    value = rate.lower().removesuffix("bit")
    scale = {"g": 1.0, "m": 1e-3, "k": 1e-6}.get(value[-1:], 1e-9)
    return float(value.rstrip("gmk")) * scale


def run_row(row: str, rate: str, args: argparse.Namespace) -> dict:
    """One row at one rate: every rank's figures, or why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        argv = [WORKER, "--row", row, "--out", str(out), "--size", args.size]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        with two_nodes.TwoNodes(rate=rate, delay=args.delay) as nodes:
            codes = nodes.run(argv, args.per_node, timeout=args.timeout, logs=Path(tmp))
            shaping = "; ".join(nodes.shaping)
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
        if codes != [0, 0] or len(ranks) != 2 * args.per_node:
            logs = "".join(p.read_text() for p in sorted(Path(tmp).glob("node*.log")))
            causes = [  # the ranks' own errors, not the launcher's
                line.split("]:", 1)[-1]
                for line in logs.splitlines()
                if line.startswith("[rank") and "Error: " in line
            ]
            error = causes[-1] if causes else logs[-300:]
            return {"row": row, "rate": rate, "failed": error.strip()[:300], "codes": codes}
    first = ranks[0]
    node_bytes = [r["node_link_bytes_per_step"] for r in ranks if r["node_link_bytes_per_step"]]
    counted = [r["engine_across_bytes_per_step"] for r in ranks]
    return {
        "row": row,
        "rate": rate,
        "shaping": shaping,
        "params": first["params"],
        "median_step_s": statistics.median(
            max(r["step_times"][i] for r in ranks) for i in range(len(first["step_times"]))
        ),
        # Both directions of node 0's end: what crossed the link, TCP included.
        "link_bytes_per_step": node_bytes[0] if node_bytes else None,
        # What the engine counts: bytes each rank received from the other node, summed.
        "engine_across_bytes_per_step": None if None in counted else sum(counted),
        "loss_after": first["losses"][-1],
        "losses": first["losses"],
    }


def report(results: list[dict], args: argparse.Namespace, stamp: str) -> str:
    lines = [
        f"# Two nodes x {args.per_node} ranks, {args.size} GPT "
        f"({results[0].get('params', 0) / 1e6:.1f}M parameters), gloo, one thread per rank",
        "",
        f"`python benchmarks/two_nodes_bench.py --rates {' '.join(args.rates)} --size "
        f"{args.size} --steps {args.steps} --warmup {args.warmup}` ({stamp}); the link "
        "is a veth pair between two network namespaces, shaped by tc on both ends; "
        f"{args.warmup} warm-up steps, then the median of {args.steps} (each the slowest "
        "rank's). Link bytes: both directions of node 0's end per step (TCP included). "
        "Engine bytes: what the engine's ranks received from the other node, summed.",
        "",
    ]
    for rate in args.rates:
        at = [r for r in results if r["rate"] == rate]
        plain = next((r for r in at if r["row"] == "zero3" and "failed" not in r), None)
        lines += [
            f"## {rate}" + (f" ({at[0].get('shaping', '')})" if at else ""),
            "",
            "| row | step (s) | vs zero3 | link MB/step | vs zero3 | engine MB/step | loss after |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in at:
            if "failed" in r:
                lines.append(f"| {r['row']} | did not run: {r['failed']} | | | | | |")
                continue
            speed = f"{plain['median_step_s'] / r['median_step_s']:.2f}x" if plain else ""
            fewer = (
                f"{plain['link_bytes_per_step'] / r['link_bytes_per_step']:.2f}x fewer"
                if plain and r["link_bytes_per_step"]
                else ""
            )
            engine = r["engine_across_bytes_per_step"]
            lines.append(
                f"| {r['row']} | {r['median_step_s']:.2f} | {speed} | "
                f"{r['link_bytes_per_step'] / 1e6:.1f} | {fewer} | "
                f"{'' if engine is None else f'{engine / 1e6:.1f}'} | {r['loss_after']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in dict.fromkeys(r["row"] for r in results):
        points = sorted(
            (gbit(r["rate"]), r["median_step_s"])
            for r in results
            if r["row"] == row and "failed" not in r
        )
        if points:
            ax.plot(*zip(*points), marker="o", label=row)
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Gbit/s, each direction)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Stage 3 across 2 nodes: step time against link rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--size", default="bench")
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--delay", default=None, help="one-way delay (needs sch_netem)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--from-json", nargs="+", type=Path, help="report earlier runs' results together"
    )
    args = parser.parse_args()
    stamp = datetime.date.today().isoformat()
    results = []
    if args.from_json:
        for path in args.from_json:
            results += json.loads(path.read_text())
        args.rates = sorted(dict.fromkeys(r["rate"] for r in results), key=gbit)
    elif why := two_nodes.unavailable():
        raise SystemExit(f"no two nodes here: {why}")
    for rate in [] if args.from_json else args.rates:
        for row in args.rows:
            result = run_row(row, rate, args)
            print(json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)
            results.append(result)
    name = f"two_nodes_{stamp}_{args.size}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{name}.md").write_text(report(results, args, stamp))
    if plot(results, args.out / f"{name}.png"):
        print(f"plot: {args.out / f'{name}.png'}")
    print(report(results, args, stamp))


if __name__ == "__main__":
    main()
