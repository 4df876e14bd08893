"""Several models prepared together in one ZeroAccelerator: one optimizer over two models
(diffusers' DreamBooth trains a UNet and a text encoder so), and a GAN's generator and
discriminator as two modules with an optimizer each. One engine shards them all; each
trains, saves, resumes and gives its own state dict as under plain Accelerate (DDP)."""

from __future__ import annotations

import pytest
import torch
from test_accelerate import _accelerator
from torch import nn

from distributed import run_reference_world, run_world
from training import rel_l2

pytest.importorskip("accelerate")

WIDTH = 16


def _stack(seed: int, first: int, last: int) -> nn.Module:
    """A few layers (several units at stage 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(first, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, last),
    )


def _batch(step: int, rank: int, world: int, width: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4 * world, width, generator=g)
    return x[4 * rank : 4 * (rank + 1)]


def _encoder_and_denoiser(rank, world, kind, stage=3, steps=range(4), save=None, load=None):
    """A text encoder whose output conditions a denoiser, one AdamW over both."""
    accelerator = _accelerator(kind, stage, accum=1)
    encoder, denoiser = _stack(0 if load is None else 5, 8, WIDTH), _stack(1, WIDTH, 8)
    both = torch.optim.AdamW([*encoder.parameters(), *denoiser.parameters()], lr=1e-2)
    encoder, denoiser, both = accelerator.prepare(encoder, denoiser, both)
    if load:
        accelerator.load_state(load)
    losses = []
    for step in steps:
        if save and step == steps[0] + 2:
            accelerator.save_state(save)
        x = _batch(step, rank, world)
        loss = (denoiser(encoder(x)) - x).pow(2).mean()
        accelerator.backward(loss)
        both.step()
        both.zero_grad()
        losses.append(loss.item())
    states = [accelerator.get_state_dict(m) for m in (encoder, denoiser)]
    accelerator.end_training()
    return {"losses": losses, "states": states}


def _gan(rank, world, kind, stage=3):
    """A generator and a discriminator, an optimizer each, stepped in turn."""
    accelerator = _accelerator(kind, stage, accum=1)
    generator, discriminator = _stack(2, 4, 8), _stack(3, 8, 1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=5e-2, momentum=0.5)
    generator, discriminator, opt_g, opt_d = accelerator.prepare(
        generator, discriminator, opt_g, opt_d
    )
    bce = nn.BCEWithLogitsLoss()
    losses = []
    for step in range(4):
        real, noise = _batch(step, rank, world), _batch(100 + step, rank, world, 4)
        fake = generator(noise)
        scores = discriminator(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)])
        d_loss = bce(scores, labels)
        accelerator.backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        g_loss = bce(discriminator(fake), torch.ones(len(fake), 1))
        accelerator.backward(g_loss)  # reaches the discriminator too, as under DDP
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        losses += [d_loss.item(), g_loss.item()]
    states = [accelerator.get_state_dict(m) for m in (generator, discriminator)]
    accelerator.end_training()
    return {"losses": losses, "states": states}


def _same_run(ours: dict, ddp: dict, initial: list[dict]) -> None:
    for got, want in zip(ours["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    for state, want, start in zip(ours["states"], ddp["states"], initial, strict=True):
        assert state.keys() == want.keys()  # each model's own names, no container prefix
        assert rel_l2(state, want) < 1e-5
        assert rel_l2(state, start) > 1e-3  # it trained


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_optimizer_over_two_models_trains_as_plain_accelerate(stage):
    ddp = run_reference_world(_encoder_and_denoiser, 2, "ddp")[0]
    ours = run_world(_encoder_and_denoiser, 2, "zero", stage)[0]
    _same_run(ours, ddp, [_stack(0, 8, WIDTH).state_dict(), _stack(1, WIDTH, 8).state_dict()])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_gans_two_models_with_an_optimizer_each_train_as_plain_accelerate(stage):
    ddp = run_reference_world(_gan, 2, "ddp")[0]
    ours = run_world(_gan, 2, "zero", stage)[0]
    _same_run(ours, ddp, [_stack(2, 4, 8).state_dict(), _stack(3, 8, 1).state_dict()])


def test_two_models_resume_from_save_state_at_another_stage(tmp_path):
    """save_state after 2 steps at stage 3, load_state into fresh models (other weights)
    at stage 1: the last 2 steps equal the uninterrupted run's."""
    ckpt = str(tmp_path / "state")
    through = run_world(_encoder_and_denoiser, 2, "zero", 3, range(4), ckpt)[0]
    resumed = run_world(_encoder_and_denoiser, 2, "zero", 1, range(2, 4), None, ckpt)[0]
    for got, want in zip(resumed["losses"], through["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    for state, want in zip(resumed["states"], through["states"], strict=True):
        assert rel_l2(state, want) < 1e-5


def _refusals(rank, world):
    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    out = []
    accelerator = _accelerator("zero", 3, accum=1)
    a, b = _stack(0, 8, WIDTH), _stack(1, WIDTH, 8)
    stray = nn.Parameter(torch.zeros(3))  # in the optimizer, in no prepared model
    try:
        accelerator.prepare(a, torch.optim.SGD([*a.parameters(), stray], lr=0.1))
    except ValueError as e:
        out.append(str(e))
    accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3, pretrained="x"))
    try:
        accelerator.prepare(a, b, torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    except ValueError as e:
        out.append(str(e))
    accelerator.end_training()
    return out


def test_what_cannot_be_sharded_together_is_refused_naming_the_fix():
    stray, pretrained = run_world(_refusals, 2)[0]
    assert "2 models trained together (Sequential, Sequential)" in pretrained
    assert "before prepare()" in pretrained
    assert "tensors of no prepared model" in stray and "same prepare() call" in stray
