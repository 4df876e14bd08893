"""Mixture-of-Students for Lightning: a callback that owns a frozen teacher, runs it on
each training batch while distillation lasts, and gives the training step the staged
distillation term.

    mos = MixtureOfStudents(teacher, weight=1.0, temperature=1.0, stop_fraction=0.5)

    class Student(L.LightningModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + mos.loss(logits)

    L.Trainer(strategy=ZeroStrategy(stage=3), callbacks=[mos]).fit(Student(), data)

At set-up the teacher becomes a frozen submodule of the LightningModule (`mos_teacher`),
so the strategy shards it with the rest (one unit gathered at a time at stage 3; no
gradient, no optimizer state; its bytes in `memory_report()`). The teacher stops after
`stop_fraction` of the training steps (or at `stop_step`), and is no longer run then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from ..moe.distillation import StagedKD, freeze, teacher_forward

TEACHER = "mos_teacher"


def _first(batch: Any) -> tuple:
    return (batch[0],) if isinstance(batch, (list, tuple)) else (batch,)


class MixtureOfStudents(Callback):
    def __init__(
        self,
        teacher: nn.Module,
        weight: float = 1.0,
        temperature: float = 1.0,
        stop_fraction: float | None = 0.5,
        stop_step: int | None = None,
        teacher_inputs: Callable[[Any], tuple] = _first,
    ):
        """`teacher_inputs(batch)` is the teacher's positional arguments (default: the
        batch's first element). `stop_step` wins over `stop_fraction`; both None: never
        stops."""
        if stop_fraction is not None and not 0 <= stop_fraction <= 1:
            raise ValueError(f"stop_fraction={stop_fraction} must be within [0, 1].")
        self.teacher = freeze(teacher)
        self.schedule = StagedKD(weight, temperature, stop_step)
        self.stop_fraction = stop_fraction
        self.teacher_inputs = teacher_inputs
        self.teacher_calls = 0
        self._logits: torch.Tensor | None = None
        self._step = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and getattr(pl_module, TEACHER, None) is None:
            pl_module.add_module(TEACHER, self.teacher)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.schedule.stop_step is None and self.stop_fraction is not None:
            self.schedule.stop_step = int(self.stop_fraction * trainer.estimated_stepping_batches)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        self._logits = None
        if self.schedule.active(self._step):
            self._logits = teacher_forward(self.teacher, *self.teacher_inputs(batch))
            self.teacher_calls += 1

    def loss(self, student_logits: torch.Tensor) -> torch.Tensor:
        """The distillation term for this batch's student logits (zero once stopped)."""
        return self.schedule.loss(student_logits, self._logits, self._step)
