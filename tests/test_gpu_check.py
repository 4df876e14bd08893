"""The prepared GPU check runs end to end on CPU (interpreter, tiny sizes), so that on a
machine with a GPU it is known to work before device time is spent on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed: the GPU check needs it")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--no-kernel-tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    calls = int(re.search(r"fused AdamW calls (\d+)", out).group(1))
    worst = float(re.search(r"worst relative loss difference ([0-9.e+-]+)", out).group(1))
    assert calls > 0 and worst < 1e-5  # the engine took the kernel path; CPU against CPU
    assert "| fused AdamW, " in out and "| MoE permute, " in out
    assert "offload_optimizer='cpu', world 1" in out and "| CPU offload" in out
    assert re.search(
        r"compiled blocks \(aot_eager\) at stage 3 on cpu: worst relative loss "
        r"difference [0-9.e+-]+ against eager",
        out,
    ), out[-2000:]
    assert "correctness: ok" in out
