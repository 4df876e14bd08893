"""One short training job, written as a new user would, that ends with or without
`destroy_process_group()`: the benchmark counts how often such a job exits with status 0.

    python benchmarks/clean_exit_worker.py DOOR PEER DESTROY
    DOOR: engine (under torchrun or, with --spawn, torch.multiprocessing.spawn),
          lightning, accelerate (under torchrun or accelerate launch)
    PEER: ours | ddp     DESTROY: yes | no
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    data = torch.randint(CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def engine_job(peer: str, destroy: bool) -> None:
    from zero_strategy import ZeroConfig, ZeroEngine

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if peer == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        for step in range(STEPS):
            model(*_batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
        for step in range(STEPS):
            engine.backward(engine(*_batch(step)))
            engine.step()
            engine.zero_grad()
    if destroy:
        dist.destroy_process_group()


def _spawned(rank: int, peer: str, destroy: bool, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    engine_job(peer, destroy)


def lightning_job(peer: str, destroy: bool) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    import zero_strategy  # noqa: F401

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(CFG)

        def training_step(self, batch, batch_idx):
            return self.model(*_batch(batch_idx))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="zero3" if peer == "ours" else "ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Lit(), DataLoader(torch.zeros(4 * STEPS, 1), batch_size=1))
    if destroy and dist.is_initialized():
        dist.destroy_process_group()


def accelerate_job(peer: str, destroy: bool) -> None:
    from accelerate import Accelerator

    if peer == "ours":
        from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

        accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3))
    else:
        accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(STEPS):
        accelerator.backward(model(*_batch(step)))
        optimizer.step()
        optimizer.zero_grad()
    if destroy:
        accelerator.end_training()


if __name__ == "__main__":
    door, peer, destroy = sys.argv[1], sys.argv[2], sys.argv[3] == "yes"
    torch.set_num_threads(1)
    if door == "engine-spawn":
        import torch.multiprocessing as mp

        port = str(29500 + os.getpid() % 20000)
        mp.spawn(_spawned, args=(peer, destroy, port), nprocs=2)
    elif door == "engine":
        engine_job(peer, destroy)
    elif door == "lightning":
        lightning_job(peer, destroy)
    else:
        accelerate_job(peer, destroy)
