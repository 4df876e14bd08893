"""Mixture-of-Students: staged knowledge distillation from a trained (PR-)MoE teacher into
a shallower student, as DeepSpeed-MoE trains its MoS models.

    model = Distillation(student, teacher, weight=1.0, temperature=1.0, stop_step=500)
    engine = ZeroEngine(model, optimizer, config)      # the teacher is sharded, frozen
    logits = model(x)                                  # the student's forward
    loss = cross_entropy(logits, y) + model.loss(logits, model.teacher_logits(x), step)

The teacher is a frozen part of the model the engine shards: at stage 3 its units are
gathered one at a time for its forward (under no_grad, each is freed after its forward),
it has no gradient and no optimizer state, and its bytes show in `memory_report()`.
Distillation stops at `stop_step`: DeepSpeed-MoE's recipe stops it part-way, because
distilling late in training hurts MoE students. The Lightning callback
(`zero_strategy.integrations.lightning_distillation`) runs the same logic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(teacher || student) of the distributions softened by `temperature`, averaged
    over tokens (every position of every sequence) and scaled by temperature², which
    keeps its gradient's size independent of the temperature."""
    vocab = student_logits.shape[-1]
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"Teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} differ: distil on the same inputs and vocabulary."
        )
    student = F.log_softmax(student_logits.float() / temperature, -1).reshape(-1, vocab)
    teacher = F.log_softmax(teacher_logits.float() / temperature, -1).reshape(-1, vocab)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


class StagedKD:
    """The distillation term and its schedule: `weight * kd_loss` for optimizer steps
    before `stop_step` (None: never stops), zero after."""

    def __init__(self, weight: float = 1.0, temperature: float = 1.0, stop_step: int | None = None):
        if weight < 0 or temperature <= 0 or (stop_step is not None and stop_step < 0):
            raise ValueError(
                "Distillation needs weight >= 0, temperature > 0 and stop_step >= 0 (or "
                f"None), got weight={weight}, temperature={temperature}, stop_step={stop_step}."
            )
        self.weight, self.temperature, self.stop_step = weight, temperature, stop_step

    def active(self, step: int) -> bool:
        """Whether optimizer step `step` (0-based) still distils."""
        return self.weight > 0 and (self.stop_step is None or step < self.stop_step)

    def loss(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        if teacher_logits is None or not self.active(step):
            return student_logits.new_zeros((), dtype=torch.float32)
        return self.weight * kd_loss(student_logits, teacher_logits, self.temperature)


class Distillation(nn.Module):
    """A student and its frozen teacher in one module (so that one engine shards both);
    calling it runs the student. `loss(student_logits, teacher_logits, step)` is the
    staged term (`StagedKD`)."""

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        weight: float = 1.0,
        temperature: float = 1.0,
        stop_step: int | None = None,
    ):
        super().__init__()
        self.student = student
        self.teacher = freeze(teacher)
        self.schedule = StagedKD(weight, temperature, stop_step)

    def forward(self, *args, **kwargs):
        return self.student(*args, **kwargs)

    def active(self, step: int) -> bool:
        return self.schedule.active(step)

    def teacher_logits(self, *args, **kwargs) -> torch.Tensor:
        return teacher_forward(self.teacher, *args, **kwargs)

    def loss(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, step: int
    ) -> torch.Tensor:
        return self.schedule.loss(student_logits, teacher_logits, step)


@torch.no_grad()
def teacher_forward(teacher: nn.Module, *args, **kwargs) -> torch.Tensor:
    """The teacher's logits, in evaluation mode whatever mode its parent is in."""
    teacher.eval()
    out = teacher(*args, **kwargs)
    return getattr(out, "logits", out)  # a Transformers output, or the logits themselves


def freeze(teacher: nn.Module) -> nn.Module:
    """No gradient, evaluation mode (no dropout, no router jitter): a fixed teacher."""
    teacher.requires_grad_(False)
    return teacher.eval()
