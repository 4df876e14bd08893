"""The optimizer's state in memory, "cpu" and on disk (and stage 3's parameters on disk
too, "+params"), beside DeepSpeed's CPU and NVMe offload; then a model whose model state
is larger than this machine's RAM, trained through the disk tier.

    python benchmarks/offload_bench.py --rounds 2              # step time, ~82M GPT
    python benchmarks/offload_bench.py --impls zero2-bf16,zero2-bf16-disk   # bf16 masters
    python benchmarks/offload_bench.py --moonshot              # model state > RAM
    python benchmarks/offload_bench.py --moonshot --dry-run    # the sizing alone

Every run: 2 ranks, gloo, one thread per rank, stage 3, fp32 AdamW, clipping 1.0 (the
engine_bench worker); other stages and bf16 compute by name (zero2-bf16-disk: stage 2,
bf16 compute with fp32 masters, the state and masters on disk), each row against its
name without the tier. The disk tiers write under --offload-dir (default: a directory
beside this checkout, on the same disk as /tmp here). DeepSpeed's NVMe row needs its
async-I/O op, which it compiles against libaio (`apt install libaio-dev`); where a peer
cannot run, the table says why.

The moonshot sizes the GPT (d 2560, vocab 16384, seq 128) from this machine: the fewest
layers whose model state (16 bytes per parameter: fp32 weights, gradients, Adam's two
moments) exceeds 1.25 times the RAM, provided the per-rank working memory fits what is
available and the disk has room for the model state (all of it is in the files between
uses: the weights, the gradients' shards and Adam's moments). Otherwise it refuses to
start, saying how much it needs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.engine_bench import run_one  # noqa: E402
from benchmarks.launch import interleaved_rounds  # noqa: E402

IMPLS = [
    "zero3",
    "zero3-cpu",
    "zero3-disk",
    "zero3-disk+params",
    "ds3",
    "ds3-cpu",
    "ds3-nvme",
    "ds3-nvme+params",
]
MOON_IMPL = "zero3-disk+params"
OVER_RAM = 1.25  # the moonshot's model state, in RAMs
GB = 1e9
WORKING_MEMORY = 3.0 * GB  # per rank beyond its shards: gathered units, activations, torch


def moon_layers(ram: float, available: float, ranks: int) -> tuple[int, int, float]:
    """(layers, parameters, in-memory bytes needed) of the moonshot GPT, or SystemExit."""
    import torch

    from benchmarks.engine_worker import SIZES
    from examples.gpt import GPT

    def params(layers: int) -> int:
        import dataclasses

        with torch.device("meta"):
            model = GPT(dataclasses.replace(SIZES["moon"], n_layer=layers))
        return sum(p.numel() for p in model.parameters())

    per_layer = params(2) - params(1)
    fixed = params(1) - per_layer
    layers = max(1, int((OVER_RAM * ram / 16 - fixed) // per_layer) + 1)  # 16 B/param
    n = params(layers)
    in_memory = ranks * WORKING_MEMORY  # the model state is on disk between uses
    if in_memory > available:
        raise SystemExit(
            f"The moonshot needs {n / 1e9:.2f}B parameters ({16 * n / GB:.1f} GB of model "
            f"state > {ram / GB:.1f} GB RAM) and {in_memory / GB:.1f} GB of memory for what "
            f"stays there; {available / GB:.1f} GB is available. Free memory and retry."
        )
    return layers, n, in_memory


def measured_disk_bandwidth(directory: Path, nbytes: int = 2 << 30) -> dict[str, float]:
    """GB/s of `dd` writing then reading `nbytes` with O_DIRECT in `directory`."""
    target = directory / "dd-probe.bin"
    block = 64 << 20
    figures = {}
    commands = {
        "write": [
            "dd",
            "if=/dev/zero",
            f"of={target}",
            f"bs={block}",
            f"count={nbytes // block}",
            "oflag=direct",
            "conv=fsync",
        ],
        "read": ["dd", f"if={target}", "of=/dev/null", f"bs={block}", "iflag=direct"],
    }
    try:
        for kind, command in commands.items():
            out = subprocess.run(command, capture_output=True, text=True, check=True).stderr
            seconds = float(re.search(r"copied, ([\d.]+) s", out).group(1))
            figures[kind] = nbytes / seconds / GB
    finally:
        target.unlink(missing_ok=True)
    return figures


def moonshot(args) -> dict:
    import psutil

    memory = psutil.virtual_memory()
    layers, n, in_memory = moon_layers(memory.total, memory.available, args.nproc)
    disk_need = 16 * n * 1.02  # fp32 weights, gradients, Adam's moments; rounded per view
    free = shutil.disk_usage(args.offload_dir).free
    print(
        f"moonshot: {layers} layers, {n / 1e9:.2f}B parameters, model state "
        f"{16 * n / GB:.1f} GB > RAM {memory.total / GB:.1f} GB; in memory "
        f"~{in_memory / GB:.1f} GB of {memory.available / GB:.1f} GB available; on disk "
        f"{disk_need / GB:.1f} GB of {free / GB:.1f} GB free in {args.offload_dir}",
        flush=True,
    )
    if disk_need > free:
        raise SystemExit(
            f"{args.offload_dir} has {free / GB:.1f} GB free; the weights and the optimizer "
            "state need "
            f"{disk_need / GB:.1f} GB. Point --offload-dir at a larger disk."
        )
    result = {"layers": layers, "params": n, "ram": memory.total, "disk_free": free}
    if args.dry_run:
        return result
    result["dd"] = measured_disk_bandwidth(args.offload_dir)
    print(
        f"dd O_DIRECT: write {result['dd']['write']:.2f} GB/s, read {result['dd']['read']:.2f} GB/s"
    )
    run_args = argparse.Namespace(
        size="moon", layers=layers, meta=True, warmup=1, steps=args.moon_steps, batch=1,
        nproc=args.nproc, timeout=args.timeout, skipped={},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        got = run_one(MOON_IMPL, run_args, out)
    if got is None:
        raise SystemExit(f"the moonshot run failed: {run_args.skipped}")
    step_phase = got["phases"]["step"]
    moved = got["io_read"] + got["io_write"]
    result.update(
        got,
        achieved_gbps=moved / step_phase / GB,
        read_gbps=got["io_read"] / step_phase / GB,
        write_gbps=got["io_write"] / step_phase / GB,
    )
    return result


def print_moonshot(res: dict) -> None:
    print(
        f"\nModel state > RAM: GPT {res['params'] / 1e9:.2f}B ({res['layers']} layers, d 2560), "
        f"{16 * res['params'] / GB:.1f} GB of model state, RAM {res['ram'] / GB:.1f} GB; "
        "stage 3, offload_optimizer='disk', offload_params='disk', 2 ranks"
    )
    print("| figure | value |\n|---|---|")
    rows = [
        ("median step (s)", f"{res['step']:.1f}"),
        ("of which the optimizer step (s)", f"{res['phases']['step']:.1f}"),
        ("peak RSS per rank (MiB)", f"{res['rss']:.0f}"),
        ("read per step per rank (GB)", f"{res['io_read'] / GB:.2f}"),
        ("written per step per rank (GB)", f"{res['io_write'] / GB:.2f}"),
        ("achieved during the step, per rank (GB/s)", f"{res['achieved_gbps']:.2f}"),
        ("dd O_DIRECT write / read (GB/s)", f"{res['dd']['write']:.2f} / {res['dd']['read']:.2f}"),
        ("losses", ", ".join(f"{v:.4f}" for v in res["loss"])),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")


def without_offload(impl: str) -> str:
    """The row an implementation is compared with: its name without the offload tier."""
    base = impl.removesuffix("+params")
    for tier in ("-cpu", "-disk", "-nvme"):
        base = base.removesuffix(tier)
    return base


def print_table(rounds: list[dict[str, dict]], skipped: dict[str, str], impls: list[str]) -> None:
    params = next(iter(rounds[0].values()))["params"] if rounds and rounds[0] else 0
    print(f"\nGPT {params / 1e6:.1f}M, 2 ranks, AdamW, {len(rounds)} rounds")
    for impl, reason in skipped.items():
        print(f"{impl}: no figures: {reason}.")
    print(
        "| impl | median step (s) | step / no offload's | optimizer step (s) "
        "| peak RSS/rank (MiB) | read/step (MB) | written/step (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for impl in impls:
        got = [rd[impl] for rd in rounds if impl in rd]
        if not got:
            continue
        base = without_offload(impl)
        ratios = [rd[impl]["step"] / rd[base]["step"] for rd in rounds if base in rd and impl in rd]
        ratio = f"{statistics.median(ratios):.2f}x" if ratios and impl != base else "-"
        print(
            f"| {impl} | {statistics.median(g['step'] for g in got):.3f} | {ratio} "
            f"| {statistics.median(g['phases']['step'] for g in got):.3f} "
            f"| {statistics.median(g['rss'] for g in got):.0f} "
            f"| {statistics.median(g['io_read'] for g in got) / 1e6:.0f} "
            f"| {statistics.median(g['io_write'] for g in got) / 1e6:.0f} |"
        )


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--size", default="bench")
    parser.add_argument("--offload-dir", type=Path, default=HERE.parent / "runs" / "offload")
    parser.add_argument("--moonshot", action="store_true")
    parser.add_argument("--moon-steps", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    args.offload_dir.mkdir(parents=True, exist_ok=True)
    os.environ["OFFLOAD_DIR"] = str(args.offload_dir)
    if args.moonshot:
        result = moonshot(args)
        if not args.dry_run:
            print_moonshot(result)
    else:
        run_args = argparse.Namespace(
            size=args.size, warmup=2, steps=args.steps, batch=4, nproc=args.nproc,
            timeout=args.timeout, skipped={},
        )  # fmt: skip
        result = interleaved_rounds(
            args.impls.split(","),
            args.rounds,
            lambda impl, out: run_one(impl, run_args, out),
            lambda res: (
                f"step {res['step']:.3f}s opt {res['phases']['step']:.3f}s "
                f"rss {res['rss']:.0f} MiB io {res['io_read'] / 1e6:.0f}/{res['io_write'] / 1e6:.0f} MB"
            ),
        )
        print_table(result, run_args.skipped, args.impls.split(","))
        result = {"rounds": result, "skipped": run_args.skipped}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
