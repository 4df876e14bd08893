"""How every benchmark starts its ranks: torchrun, 2 processes, one thread each."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(
    script: str, *args: str, nproc: int = 2, timeout: float | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        script,
        *args,
    ]
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=check
    )
