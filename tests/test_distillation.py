"""Mixture-of-Students: a shallower MoE student distilled from a frozen MoE teacher, the
teacher sharded like any model (stage 3: one unit gathered at a time) with no gradient
and no optimizer state, distillation stopping at the configured step; the same training
as one process computing cross-entropy plus the weighted KL by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from zero_strategy.moe import moe_losses
from zero_strategy.moe.distillation import Distillation, StagedKD, kd_loss

TEACHER = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, n_experts=4)
STUDENT = replace(TEACHER, n_layer=1)
STEPS, PER_RANK, WEIGHT, TEMPERATURE = 6, 2, 0.5, 2.0


def test_kd_loss_equals_a_hand_computation():
    student = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]]])
    teacher = torch.tensor([[[0.0, 2.0, 1.0], [1.0, -1.0, 0.0]]])
    t = 2.0
    total = 0.0
    for s_row, t_row in zip(student[0].tolist(), teacher[0].tolist()):
        zs = sum(math.exp(v / t) for v in s_row)
        zt = sum(math.exp(v / t) for v in t_row)
        for sv, tv in zip(s_row, t_row):
            p, q = math.exp(tv / t) / zt, math.exp(sv / t) / zs
            total += p * math.log(p / q)
    want = total / 2 * t * t  # mean over the 2 tokens, times T^2
    assert kd_loss(student, teacher, t).item() == pytest.approx(want, rel=1e-6)
    assert kd_loss(teacher, teacher, t).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="differ"):
        kd_loss(student, teacher[..., :2])


def test_the_schedule_stops_and_bad_settings_are_refused():
    schedule = StagedKD(weight=1.0, stop_step=3)
    assert [schedule.active(s) for s in range(5)] == [True, True, True, False, False]
    logits = torch.randn(2, 3)
    assert schedule.loss(logits, torch.randn(2, 3), 3).item() == 0.0
    with pytest.raises(ValueError, match="temperature > 0"):
        StagedKD(temperature=0.0)


def models():
    torch.manual_seed(1)
    teacher = GPT(replace(TEACHER, ep_size=None))
    torch.manual_seed(0)
    student = GPT(replace(STUDENT, ep_size=None))
    return student, teacher


def full(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(TEACHER.vocab_size, (2 * PER_RANK, TEACHER.block_size + 1), generator=g)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    part = full(step)[rank::2]
    return part[:, :-1], part[:, 1:]


def loader() -> torch.utils.data.DataLoader:
    """The steps' samples in order (Lightning deals them to the ranks)."""
    data = torch.cat([full(step) for step in range(STEPS)])
    pairs = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])
    return torch.utils.data.DataLoader(pairs, batch_size=PER_RANK)


def step_loss(student, logits, y, kd):
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return ce + moe_losses(student) + kd


def one_process(stop_step: int, batches=None) -> list[float]:
    """Both ranks' batches in turn (`batches[step][rank]`, default `batch(step, rank)`),
    every expert here; the mean of the ranks' losses."""
    student, teacher = models()
    teacher.eval()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    schedule = StagedKD(WEIGHT, TEMPERATURE, stop_step)
    out = []
    for step in range(STEPS):
        losses = []
        for rank in range(2):
            x, y = batch(step, rank) if batches is None else batches[step][rank]
            with torch.no_grad():
                teacher_logits = teacher(x)
            logits = student(x)
            losses.append(
                step_loss(student, logits, y, schedule.loss(logits, teacher_logits, step))
            )
        loss = sum(losses) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _lightning(rank, world, distil: bool):
    import lightning as L
    from lightning_helpers import quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy
    from zero_strategy.integrations.lightning_distillation import MixtureOfStudents

    student, teacher = models()
    teacher_numel = sum(p.numel() for p in teacher.parameters())
    mos = MixtureOfStudents(teacher, WEIGHT, TEMPERATURE, stop_fraction=0.5)
    gathered_teacher_units: list[int] = []

    class Student(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = student
            self.losses = []
            self.batches = []

        def training_step(self, pair, batch_idx):
            x, y = pair
            self.batches.append((x.clone(), y.clone()))
            logits = self.model(x)
            loss = step_loss(self.model, logits, y, mos.loss(logits) if distil else 0.0)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    class CountGathered(L.Callback):
        """At each teacher block's forward: which teacher blocks' units are gathered (the
        root unit, embeddings and heads, is held for the whole forward as in any)."""

        def on_train_start(self, trainer, pl_module):
            blocks = [
                u
                for u in trainer.strategy.engine.units
                if all(s.name.startswith("mos_teacher.blocks.") for s in u.layout.slots)
            ]

            def record(*_):
                gathered = {
                    u.layout.slots[0].name.split(".")[2] for u in blocks if u.gathered_bytes()
                }
                gathered_teacher_units.append(sorted(gathered))

            for block in pl_module.mos_teacher.blocks:
                block.register_forward_pre_hook(record)

    module = Student()
    callbacks = [mos, CountGathered()] if distil else []
    trainer = quiet_trainer(
        world, ZeroStrategy(stage=3, expert_parallel_size=2), max_steps=STEPS, callbacks=callbacks
    )
    trainer.fit(module, loader())
    engine = trainer.strategy.engine
    teacher_grads = [p.grad for p in teacher.parameters() if p.grad is not None]
    return {
        "losses": module.losses,
        "batches": module.batches,
        "calls": mos.teacher_calls,
        "report": engine.memory_report(),
        "teacher_grads": len(teacher_grads),
        "trainable_teacher": sum(p.requires_grad for p in teacher.parameters()),
        "gathered": gathered_teacher_units,
        "teacher_numel": teacher_numel,
    }


def test_lightning_mixture_of_students_matches_one_process_and_stops():
    with_teacher = run_world(_lightning, 2, True)
    without = run_world(_lightning, 2, False)
    want = one_process(STEPS // 2, list(zip(*(r["batches"] for r in with_teacher))))
    mean = [sum(v) / 2 for v in zip(*(r["losses"] for r in with_teacher))]
    assert mean == pytest.approx(want, rel=1e-5)
    # A control: the KD term changed the first half, and only the first half.
    plain = [sum(v) / 2 for v in zip(*(r["losses"] for r in without))]
    assert all(abs(a - b) > 1e-4 for a, b in zip(mean[:1], plain[:1]))
    added = 0
    for ours, theirs in zip(with_teacher, without):
        assert ours["calls"] == STEPS // 2  # the teacher is no longer run once stopped
        assert ours["teacher_grads"] == 0 and ours["trainable_teacher"] == 0
        # Stage 3: one teacher block gathered at a time, the one running.
        blocks = [str(i) for i in range(TEACHER.n_layer)]
        assert ours["gathered"] == [[b] for b in blocks] * (STEPS // 2)
        added += ours["report"]["parameters"] - theirs["report"]["parameters"]

    # No optimizer state and no gradient memory for the teacher, on every rank: its
    # embeddings and head (outside every block) are a frozen unit of their own, not part
    # of the student's root unit.
    for ours, theirs in zip(with_teacher, without):
        for kind in ("optimizer_state", "gradients"):
            assert ours["report"][kind] == theirs["report"][kind], kind
    # Over both ranks the teacher is held once (each expert-parallel rank holds half its
    # experts, ZeRO-3 splits the rest in two), give or take the padding of its 7 units
    # (3 blocks, 3 expert groups, its embeddings and head) to an even split.
    teacher_bytes = 4 * with_teacher[0]["teacher_numel"]
    assert teacher_bytes <= added <= teacher_bytes + 4 * 7


def distil(model, student, rank, backward, step) -> list[float]:
    """The staged distillation loop a plain-engine or Fabric user writes."""
    losses = []
    for i in range(STEPS):
        x, y = batch(i, rank)
        teacher_logits = model.teacher_logits(x) if model.active(i) else None
        logits = model(x)
        loss = step_loss(student, logits, y, model.loss(logits, teacher_logits, i))
        backward(loss)
        step()
        losses.append(loss.item())
    return losses


def _engine(rank, world):
    from zero_strategy import ZeroConfig, ZeroEngine

    student, teacher = models()
    model = Distillation(student, teacher, WEIGHT, TEMPERATURE, stop_step=STEPS // 2)
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(student.parameters(), lr=1e-2),
        ZeroConfig(stage=3, expert_parallel_size=2),
    )
    return distil(
        model, student, rank, engine.backward, lambda: (engine.step(), engine.zero_grad())
    )


def test_plain_engine_distillation_matches_one_process():
    want = one_process(stop_step=STEPS // 2)
    mean = [sum(v) / 2 for v in zip(*run_world(_engine, 2))]
    assert mean == pytest.approx(want, rel=1e-5)


def _fabric(rank, world):
    import os

    import lightning as L

    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    strategy = ZeroFabricStrategy(stage=3, expert_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    student, teacher = models()
    model = Distillation(student, teacher, WEIGHT, TEMPERATURE, stop_step=STEPS // 2)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    step = lambda: (optimizer.step(), optimizer.zero_grad())  # noqa: E731
    return distil(model, student, rank, fabric.backward, step)


def test_fabric_distillation_matches_one_process():
    want = one_process(stop_step=STEPS // 2)
    mean = [sum(v) / 2 for v in zip(*run_world(_fabric, 2))]
    assert mean == pytest.approx(want, rel=1e-5)
