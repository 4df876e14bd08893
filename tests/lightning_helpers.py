"""A LightningModule and Trainer runner shared by the Lightning tests. Ranks are forked
by tests/distributed.py with the process group already up, as under torchrun."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from training import TINY, make_model, make_optimizer

STEPS = 20


def parallelized_module(build, parallelize, loss_of, lr: float, real_init: bool = True):
    """The LightningModule a ModelParallelStrategy user writes: `configure_model` builds
    the model (`build()`: for real, so that strategies start from the same seeded
    weights; or with `real_init` False on the meta device the strategy gives it, for the
    engine to initialise) and hands it with the strategy's mesh to `parallelize(model,
    device_mesh)`; each step's loss (`loss_of(model, ids)`) is recorded."""
    import contextlib

    import lightning as L

    class Parallelized(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None
            self.losses: list[float] = []

        def configure_model(self):
            if self.model is not None:
                return
            with torch.device("cpu") if real_init else contextlib.nullcontext():
                self.model = build()
            parallelize(self.model, self.device_mesh)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = loss_of(self.model, ids)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr)

    return Parallelized()


def lit_module_class():
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self, lr_schedule: bool = False):
            super().__init__()
            self.save_hyperparameters()
            self.model = make_model()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model(x, y)
            self.log("train_loss", loss, sync_dist=True)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model(x, y)
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            opt = make_optimizer(self.model)
            if not self.hparams.lr_schedule:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitGPT


def quiet_trainer(world: int, strategy, pl_module=None, **kwargs):
    """A Trainer on `world` CPU devices with logging, checkpoints and bars off."""
    if pl_module is None:
        import lightning.pytorch as pl_module
    defaults = dict(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl_module.Trainer(**{**defaults, **kwargs})


def loader(n_batches: int = 2 * STEPS, per_rank: int = 2, world: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(
        TINY.vocab_size, (n_batches * per_rank * world, TINY.block_size + 1), generator=g
    )
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=per_rank, shuffle=False)


def fit(
    rank: int,
    world: int,
    strategy,
    max_steps: int = STEPS,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    lr_schedule: bool = False,
    epoch_steps: int | None = None,
    accumulate: int = 2,
    clip: float = 0.5,
    save_at_end: str | None = None,
    **trainer_kwargs,
):
    import lightning as L

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    callbacks = []
    if ckpt_dir:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{step}"
            )
        )
    trainer = quiet_trainer(
        world,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        enable_checkpointing=bool(ckpt_dir),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    module = lit_module_class()(lr_schedule=lr_schedule)
    batches = accumulate * (STEPS if epoch_steps is None else epoch_steps)
    trainer.fit(module, loader(n_batches=batches, world=world), ckpt_path=resume)
    if save_at_end:
        trainer.save_checkpoint(save_at_end)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    return {
        "losses": module.losses,
        "strategy": type(trainer.strategy).__name__,
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "lr": lr,
        "global_step": trainer.global_step,
        "compute_dtype": getattr(
            getattr(trainer.strategy, "engine_config", None), "compute_dtype", None
        ),
    }
