"""How every benchmark starts its ranks: torchrun, 2 processes, one thread each."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable


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
    script: str,
    impl: str,
    out: str,
    *args: str,
    nproc: int = 2,
    timeout: float | None = None,
    failures: dict[str, str] | None = None,
) -> list[dict] | None:
    """Run `script --impl impl ... --out out` on `nproc` ranks; each rank's JSON result
    (`<out>/<impl>.rank<r>.json`), or None (with the error printed, and said in
    `failures[impl]`) when the run failed."""
    import json
    from pathlib import Path

    proc = torchrun(
        script, "--impl", impl, *args, "--out", out, nproc=nproc, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        print(f"  {impl}: failed (rc={proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        if failures is not None:
            killed = "exitcode  : -9" in proc.stderr
            failures[impl] = (
                "a rank was killed by SIGKILL (on this machine, the kernel's out-of-memory killer)"
                if killed
                else f"failed with exit code {proc.returncode} (its error is in the log)"
            )
        return None
    return [json.loads(Path(out, f"{impl}.rank{r}.json").read_text()) for r in range(nproc)]


def interleaved_rounds(
    impls: list[str],
    rounds: int,
    run: Callable[[str, str], dict | None],
    describe: Callable[[dict], str],
) -> list[dict[str, dict]]:
    """`rounds` rounds of `run(impl, out_dir)` over every implementation, in a different
    order each round (rotated, and reversed every other round: the machine is noisy, so
    no implementation always runs first or last); each result printed by `describe`."""
    import tempfile

    results: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(rounds):
            order = impls[r % len(impls) :] + impls[: r % len(impls)]
            if r % 2:
                order.reverse()
            got = {}
            for impl in order:
                res = run(impl, out)
                if res:
                    got[impl] = res
                    print(f"round {r} {impl:7s} {describe(res)}", flush=True)
            results.append(got)
    return results
