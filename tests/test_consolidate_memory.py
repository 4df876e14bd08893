"""Consolidation streams: its peak RSS stays under twice the largest tensor plus 400 MB,
here well below the size of the model itself."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors import safe_open
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine

LAYERS, WIDTH = 32, 2048  # 32 x 16 MiB = 512 MiB of fp32 parameters
# What `zero-strategy consolidate` imports before it reads a tensor.
CONSOLIDATION_MODULES = (
    "zero_strategy.cli",
    "zero_strategy.checkpoint.consolidate",
    "safetensors.torch",
)

MEASURE = (
    "import resource, subprocess, sys\n"
    "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "sys.stderr.write(proc.stderr)\n"
    "print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
)


def _write(rank, world, path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    engine.save_checkpoint(path)
    last = engine.full_state_dict()
    return last[f"{LAYERS - 1}.weight"][:2, :5].clone() if rank == 0 else None


def _peak_rss(command: list[str]) -> int:
    """The peak resident bytes of `command`, run to success in a process of its own."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True)
    rc, peak = (int(x) for x in out.stdout.split()[-2:])
    assert rc == 0, out.stderr
    return peak


def test_consolidation_peak_rss_is_bounded_by_the_largest_tensor(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    corner = run_world(_write, 2, ckpt, timeout=300)[0]
    model_bytes = LAYERS * WIDTH * WIDTH * 4
    largest = WIDTH * WIDTH * 4
    cmd = [
        sys.executable,
        "-m",
        "zero_strategy.cli",
        "consolidate",
        ckpt,
        str(tmp_path / "out"),
        "--quiet",
    ]
    peak = _peak_rss(cmd)
    # What the interpreter holds before any tensor: torch's own libraries (about 220 MiB
    # for a CPU build, 640 MiB for a CUDA one, even with no GPU).
    base = _peak_rss([sys.executable, "-c", f"import {', '.join(CONSOLIDATION_MODULES)}"])
    print(f"peak {peak / 2**20:.0f} MiB, of which imports {base / 2**20:.0f} MiB")
    assert peak - base < 2 * largest + (96 << 20), (peak - base) / 2**20
    assert peak - base < model_bytes / 4, ((peak - base) / 2**20, model_bytes / 2**20)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == LAYERS
        assert torch.equal(f.get_slice(f"{LAYERS - 1}.weight")[:2, :5], corner)


def test_importing_the_package_leaves_dynamo_and_dtensor_unloaded():
    """`torch._dynamo` costs about 100 MB of resident memory, `torch.distributed.tensor`
    half a second: the consolidation command and a plain `import zero_strategy` (each
    rank of a torchrun job) must load neither (the hooks load dynamo when first made; a
    model with DTensors has loaded DTensor itself)."""
    probe = (
        "import sys, zero_strategy, zero_strategy.cli\n"
        "print([m in sys.modules for m in ('torch._dynamo', 'torch.distributed.tensor')])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.splitlines()[-1] == "[False, False]", out.stdout + out.stderr
