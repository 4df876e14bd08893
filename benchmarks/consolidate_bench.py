"""Consolidation side by side: `zero-strategy consolidate` against DeepSpeed's
`zero_to_fp32.py`, on ZeRO-3 checkpoints of the same GPT written by 2 CPU ranks.

    python benchmarks/consolidate_bench.py            # ~134M parameters, ~1.6 GB checkpoint
    python benchmarks/consolidate_bench.py --size tiny  # a quick smoke run

Each consolidation runs as its own process under `/usr/bin/time -v` equivalent
(resource.getrusage of the child): wall time and peak RSS (max resident set size).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launch import torchrun  # noqa: E402

WRITER = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from examples.gpt import GPT, GPTConfig
SIZES = {{
    "bench": GPTConfig(vocab_size=32000, block_size=128, n_layer=12, n_head=12, n_embd=768, tie_embeddings=False),
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False),
}}
impl, size, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(SIZES[size])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(SIZES[size].vocab_size, (1, 33))
if impl == "deepspeed":
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={{
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3}}}})
    engine.backward(engine(x[:, :-1], x[:, 1:])); engine.step()
    engine.save_checkpoint(out, tag="step1")
else:
    dist.init_process_group("gloo")
    from zero_strategy import ZeroConfig, ZeroEngine
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3))
    engine.backward(engine(x[:, :-1], x[:, 1:])); engine.step()
    engine.save_checkpoint(out)
dist.barrier()
"""


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_checkpoint(impl: str, size: str, out: Path) -> None:
    script = out.parent / f"write_{impl}.py"
    script.write_text(WRITER.format(root=str(ROOT)))
    torchrun(str(script), impl, size, str(out))


_MEASURE = (
    "import resource, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "wall = time.perf_counter() - start\n"
    "sys.stderr.write(proc.stderr[-3000:])\n"
    "print(proc.returncode, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def measure(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one process, measured by a fresh parent whose
    only child it is (ru_maxrss of children is a maximum over all of them)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env
    )
    rc, wall, peak_kib = out.stdout.split()[-3:]
    if rc != "0":
        raise SystemExit(f"{cmd[:3]} failed:\n{out.stderr}")
    return float(wall), int(peak_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="bench", choices=["bench", "tiny"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="consolidate_bench_"))
    try:
        ds_ckpt, our_ckpt = work / "ds", work / "ours"
        write_checkpoint("deepspeed", args.size, ds_ckpt)
        write_checkpoint("ours", args.size, our_ckpt)
        ours = measure(
            [
                sys.executable,
                "-m",
                "zero_strategy.cli",
                "consolidate",
                str(our_ckpt),
                str(work / "ours_out"),
                "--quiet",
            ]
        )
        ds = measure(
            [
                sys.executable,
                str(ds_ckpt / "zero_to_fp32.py"),
                str(ds_ckpt),
                str(work / "ds_out"),
                "--safe_serialization",
            ]
        )
        print(
            f"checkpoint on disk: ours {dir_bytes(our_ckpt) / 2**30:.2f} GiB, "
            f"DeepSpeed {dir_bytes(ds_ckpt) / 2**30:.2f} GiB"
        )
        print("| tool | wall (s) | peak RSS (MiB) |")
        print("|---|---|---|")
        print(f"| zero-strategy consolidate | {ours[0]:.1f} | {ours[1]:.0f} |")
        print(f"| DeepSpeed zero_to_fp32.py | {ds[0]:.1f} | {ds[1]:.0f} |")
        print(
            f"peak RSS ratio ours/DeepSpeed {ours[1] / ds[1]:.2f}, time ratio {ours[0] / ds[0]:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
