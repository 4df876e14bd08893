"""Framework overhead: `Trainer(strategy="zero3")` and `ZeroAccelerator` against the
plain ZeroEngine loop, and each against its framework's DDP (`Trainer(strategy="ddp")`,
plain `Accelerator`); same GPT, same batches, 2 ranks, gloo, 1 thread/rank, clip 1.0.

    python benchmarks/integration_bench.py --rounds 3

Step time is measured the same way everywhere: from the start of a batch to the end of
its optimizer step (Lightning: on_train_batch_start to on_train_batch_end). Rounds run
interleaved; the table shows medians and per-round ratios' medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import torchrun  # noqa: E402

IMPLS = ["engine-zero3", "lightning-zero3", "lightning-ddp", "accelerate-zero3", "accelerate-ddp"]


def _data(cfg, n: int, per_rank: int):
    import torch

    g = torch.Generator().manual_seed(0)
    data = torch.randint(cfg.vocab_size, (n * per_rank * 2, cfg.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def worker(impl: str, size: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.engine_worker import SIZES
    from examples.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = SIZES[size]
    x, y = _data(cfg, steps, 4)
    times: list[float] = []
    if impl == "engine-zero3":
        from zero_strategy import ZeroConfig, ZeroEngine

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = GPT(cfg)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            ZeroConfig(stage=3, gradient_clipping=1.0),
        )
        xs, ys = x[rank::2], y[rank::2]
        for i in range(steps):
            t0 = time.perf_counter()
            engine.backward(engine(xs[i * 4 : (i + 1) * 4], ys[i * 4 : (i + 1) * 4]))
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
    elif impl.startswith("accelerate"):
        from accelerate import Accelerator

        from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

        if impl == "accelerate-zero3":
            accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3))
        else:
            accelerator = Accelerator(cpu=True)
        model = GPT(cfg)
        model, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        )
        rank = accelerator.process_index
        xs, ys = x[rank::2], y[rank::2]
        for i in range(steps):
            t0 = time.perf_counter()
            accelerator.backward(model(xs[i * 4 : (i + 1) * 4], ys[i * 4 : (i + 1) * 4]))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
    else:
        import lightning as L
        from torch.utils.data import DataLoader, TensorDataset

        import zero_strategy  # noqa: F401

        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = GPT(cfg)

            def training_step(self, batch, batch_idx):
                return self.model(*batch)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

        class Timer(L.Callback):
            def on_train_batch_start(self, *a):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, *a):
                times.append(time.perf_counter() - self.t0)

        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=impl.split("-")[1],
            max_steps=steps,
            gradient_clip_val=1.0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Timer()],
        )
        trainer.fit(Lit(), DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
        rank = trainer.global_rank
    Path(out, f"{impl}.{rank}.json").write_text(json.dumps(times))


def run(impl: str, args, out: str) -> float:
    torchrun(
        __file__, "--worker", impl, "--size", args.size, "--steps", str(args.steps), "--out", out
    )
    per_rank = [
        json.loads(Path(out, f"{impl}.{r}.json").read_text())[args.warmup :] for r in range(2)
    ]
    return max(statistics.median(t) for t in per_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default="")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.steps, args.out)
        return
    rounds = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            rounds.append({impl: run(impl, args, out) for impl in order})
            print(
                f"round {r}: " + ", ".join(f"{k} {v:.3f}s" for k, v in rounds[-1].items()),
                flush=True,
            )

    def ratio(a: str, b: str) -> float:
        return statistics.median(rd[a] / rd[b] for rd in rounds)

    print("\n| impl | median step (s) |\n|---|---|")
    for impl in IMPLS:
        print(f"| {impl} | {statistics.median(rd[impl] for rd in rounds):.3f} |")
    print(
        f"Lightning overhead over the plain engine loop: {100 * (ratio('lightning-zero3', 'engine-zero3') - 1):+.1f}%"
    )
    print(f"Trainer zero3 step time / Trainer ddp: {ratio('lightning-zero3', 'lightning-ddp'):.2f}")
    print(
        f"Accelerate overhead over the plain engine loop: {100 * (ratio('accelerate-zero3', 'engine-zero3') - 1):+.1f}%"
    )
    print(
        f"ZeroAccelerator step time / Accelerator (DDP): {ratio('accelerate-zero3', 'accelerate-ddp'):.2f}"
    )


if __name__ == "__main__":
    main()
