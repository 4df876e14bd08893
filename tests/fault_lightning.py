"""A Trainer(strategy="zero3") run under torchrun that saves `last.ckpt` after every
step and resumes with fit(ckpt_path="last"). With KILL >= 0, torchrun's first attempt
kills rank 1 halfway through writing its shard of the save after step KILL: last.ckpt
must still be the whole previous checkpoint, from which the restart resumes.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/fault_lightning.py DIR STEPS KILL

Rank 0 writes {global step: its loss} to DIR/losses.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import zero_strategy  # noqa: E402, F401
from training import local_batch, make_model, make_optimizer  # noqa: E402
from zero_strategy.checkpoint import save_agreement  # noqa: E402


def main(directory: str, steps: str, kill: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = Path(directory, "losses.json")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    class StepData(L.LightningModule):
        """Each step's batch comes from its global step, so a resumed run sees the same
        data as an uninterrupted one whatever the data loader does on resume."""

        def __init__(self):
            super().__init__()
            self.model = make_model()

        def training_step(self, batch, batch_idx):
            x, y = local_batch(self.global_step, 0, self.global_rank, self.trainer.world_size)
            loss = self.model(x, y)
            if self.global_rank == 0:
                losses = json.loads(out.read_text()) if out.exists() else {}
                losses[str(self.global_step)] = loss.item()
                out.write_text(json.dumps(losses))
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.model)

    real_save_file = save_agreement.save_file

    def save_file(tensors, target):
        real_save_file(tensors, target)
        killing = first_attempt and int(os.environ["RANK"]) == 1
        if killing and Path(target).parent.name == "last.ckpt.tmp" and f"step={kill}" in marker:
            data = Path(target).read_bytes()
            Path(target).write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    marker = ""
    save_agreement.save_file = save_file

    class Marker(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            nonlocal marker
            marker = f"step={trainer.global_step}"

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="zero3",
        max_steps=int(steps),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Marker(),
            ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1),
        ],
    )
    data = DataLoader(torch.zeros(4 * int(steps), 1), batch_size=1)
    trainer.fit(StepData(), data, ckpt_path="last")
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
