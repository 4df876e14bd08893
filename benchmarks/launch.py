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


def run_ranks(
    script: str, impl: str, out: str, *args: str, nproc: int = 2, timeout: float | None = None
) -> list[dict] | None:
    """Run `script --impl impl ... --out out` on `nproc` ranks; each rank's JSON result
    (`<out>/<impl>.rank<r>.json`), or None (with the error printed) when the run failed."""
    import json
    from pathlib import Path

    proc = torchrun(
        script, "--impl", impl, *args, "--out", out, nproc=nproc, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        print(f"  {impl}: failed (rc={proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return [json.loads(Path(out, f"{impl}.rank{r}.json").read_text()) for r in range(nproc)]
