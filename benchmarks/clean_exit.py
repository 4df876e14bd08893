"""How often a finished 2-rank job exits with status 0, per door, ours beside stock DDP,
with and without a final `destroy_process_group()` in the user's script.

A gloo job can end in "terminate called without an active exception" (SIGABRT) at
interpreter exit, which a scheduler reads as a failed job. Each cell runs the same short
job (benchmarks/clean_exit_worker.py) RUNS times and counts exit status 0.

    python benchmarks/clean_exit.py [--runs 30] [--doors engine-torchrun,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "clean_exit_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
DOORS = {
    # door: (launcher argv prefix, worker door, how the user ends it when DESTROY=yes)
    "engine-torchrun": (TORCHRUN, "engine", "destroy_process_group()"),
    "engine-spawn": ([sys.executable], "engine-spawn", "destroy_process_group()"),
    "lightning": ([sys.executable], "lightning", "destroy_process_group()"),
    "accelerate-torchrun": (TORCHRUN, "accelerate", "accelerator.end_training()"),
    "accelerate-launch": (
        [
            *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"),
            *("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"),
            *("--dynamo_backend", "no", "--main_process_port", "0"),
        ],
        "accelerate",
        "accelerator.end_training()",
    ),
}


def run_once(door: str, peer: str, destroy: str, timeout: float = 180) -> tuple[int | None, bool]:
    prefix, worker_door, _ = DOORS[door]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            [*prefix, WORKER, worker_door, peer, destroy],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, False
    aborted = "terminate called" in proc.stderr or "Aborted" in proc.stderr
    if proc.returncode != 0 and not aborted:
        print(proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode, aborted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--doors", default=",".join(DOORS))
    parser.add_argument("--out", default=str(HERE / "results" / f"clean_exit_{date.today()}"))
    args = parser.parse_args()
    rows = []
    for door in args.doors.split(","):
        for destroy in ("yes", "no"):
            cell = {}
            for peer in ("ours", "ddp"):
                start = time.monotonic()
                codes = []
                aborts = 0
                for _ in range(args.runs):  # interleaving peers would not change the count
                    rc, aborted = run_once(door, peer, destroy)
                    codes.append(rc)
                    aborts += aborted
                cell[peer] = {
                    "clean": sum(rc == 0 for rc in codes),
                    "aborts": aborts,
                    "codes": sorted({str(c) for c in codes}),
                    "seconds": round(time.monotonic() - start, 1),
                }
            row = {"door": door, "destroy": destroy, "ending": DOORS[door][2], **cell}
            rows.append(row)
            print(
                f"{door:20s} destroy={destroy:3s}  ours {cell['ours']['clean']}/{args.runs} "
                f"(aborts {cell['ours']['aborts']})  ddp {cell['ddp']['clean']}/{args.runs} "
                f"(aborts {cell['ddp']['aborts']})",
                flush=True,
            )
    Path(args.out + ".json").write_text(json.dumps({"runs": args.runs, "rows": rows}, indent=1))
    lines = [
        f"Clean exits in {args.runs} runs (exit status 0), 2 ranks, gloo, "
        f"{os.cpu_count()} cores; `python benchmarks/clean_exit.py --runs {args.runs}`",
        "",
        "| door | user's script ends with | ours | stock DDP |",
        "|---|---|---|---|",
    ]
    for r in rows:
        ending = r["ending"] if r["destroy"] == "yes" else "nothing"
        lines.append(
            f"| {r['door']} | {ending} | {r['ours']['clean']}/{args.runs} "
            f"(aborts {r['ours']['aborts']}) | {r['ddp']['clean']}/{args.runs} "
            f"(aborts {r['ddp']['aborts']}) |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
