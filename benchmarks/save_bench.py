"""Checkpoint saves side by side, on 2 CPU ranks at stage 3 (a ~134M-parameter GPT):

- sharded: the default directory, every rank its own safetensors file;
- one file: `state_dict_type="full"`, every rank writing its own ranges of one torch file;
- one file through a copy: the same file made the way it was before, a sharded copy
  written first and streamed into the file by rank 0 (kept for tensor parallelism).

    python benchmarks/save_bench.py                 # ~134M parameters, ~1.6 GB per save
    python benchmarks/save_bench.py --size tiny     # a quick smoke run

The three run in turn, in a rotated order each round, in the same processes; each save
is timed from a barrier before it to a barrier after it (every rank done), fsyncs
included. Printed: the median wall per kind, its ratio to the sharded save's, the bytes
each rank wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

KINDS = ["sharded", "one file", "one file through a copy"]


def _worker(size: str, rounds: int, out: str, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from examples.gpt import GPT, GPTConfig
    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.checkpoint.one_file_writer import _through_a_sharded_copy

    sizes = {
        "bench": GPTConfig(vocab_size=32000, block_size=128, n_layer=12, n_head=12, n_embd=768),
        "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64),
    }
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(sizes[size])
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
    x = torch.randint(sizes[size].vocab_size, (2, 33))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()

    def save(kind: str, path: str) -> None:
        if kind == "sharded":
            engine.save_checkpoint(path)
        elif kind == "one file":
            engine.save_checkpoint(path, one_file=True)
        else:  # the former path, as the tensor-parallel case still takes it
            meta = dict(
                step=engine.global_steps,
                compute_dtype=engine.config.compute_torch_dtype,
                loss_scaler=engine.optim.scaler.state_dict(),
            )
            target = Path(path)
            partial = target.with_name(f".{target.name}.partial")
            state = engine._door._sharded_state()
            _through_a_sharded_copy(state, target, partial, None, None, meta)

    times: dict[str, list[float]] = {k: [] for k in KINDS}
    sizes_on_disk: dict[str, int] = {}
    for r in range(rounds):
        order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
        for kind in order:
            path = os.path.join(folder, f"r{r}-{kind.replace(' ', '_')}")
            dist.barrier()
            start = time.perf_counter()
            save(kind, path)
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
            if rank == 0:
                p = Path(path)
                files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
                sizes_on_disk[kind] = sum(f.stat().st_size for f in files)
                shutil.rmtree(path, ignore_errors=True) if p.is_dir() else p.unlink()
            dist.barrier()
    engine.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "bytes": sizes_on_disk}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "FOLDER"))
    args = parser.parse_args()
    if args.worker:
        _worker(args.size, args.rounds, *args.worker)
        return
    from benchmarks.launch import torchrun

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as folder:
        script = str(Path(__file__).resolve())
        extra = ["--size", args.size, "--rounds", str(args.rounds)]
        torchrun(script, *extra, "--worker", out, folder, timeout=3600)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    times = ranks[0]["times"]  # barrier to barrier: the same on every rank
    base = statistics.median(times["sharded"])
    print(f"2 CPU ranks, stage 3, GPT size {args.size}, {args.rounds} rounds (median wall)")
    print("| save | wall (s) | against sharded | on disk (MiB) |")
    print("| --- | --- | --- | --- |")
    for kind in KINDS:
        wall = statistics.median(times[kind])
        mib = ranks[0]["bytes"][kind] / 2**20
        print(f"| {kind} | {wall:.2f} | {wall / base:.2f}x | {mib:.0f} |")
        print(f"  {kind}: each round {[round(t, 2) for t in times[kind]]}")


if __name__ == "__main__":
    main()
