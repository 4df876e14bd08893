"""The engine's fused optimizer step (the Triton AdamW kernel, run here by the interpreter on
CPU) trains like torch's AdamW, keeps torch's optimizer-state layout, and steps aside for
what it does not implement."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the fused step cannot be tested")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "runs the Triton path on CPU tensors, which needs the interpreter; on a GPU machine "
        "benchmarks/gpu_check.py trains the engine through the compiled kernel instead",
        allow_module_level=True,
    )

from distributed import run_world
from examples.gpt import decay_groups
from training import local_batch, make_model
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.kernels import use_backend

STEPS = 4


def _train(rank, world, backend, stage, compute_dtype="fp32", clip=0.5, amsgrad=False):
    model = make_model()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=3e-3, betas=(0.9, 0.95), amsgrad=amsgrad)
    config = ZeroConfig(stage=stage, gradient_clipping=clip, compute_dtype=compute_dtype)
    engine = ZeroEngine(model, optimizer, config)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    with use_backend(backend):
        for step in range(STEPS):
            x, y = local_batch(step, 0, rank, world)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            scheduler.step()
            losses.append(loss.item())
    state = engine.full_state_dict()
    opt_state = optimizer.state_dict()["state"]
    layout = sorted({tuple(sorted(s)) for s in opt_state.values()})
    steps = sorted({float(s["step"]) for s in opt_state.values()})
    groups_here = sum(1 for g in optimizer.param_groups if g["params"])
    return losses, state, engine.fused_step.launches / (STEPS * groups_here), layout, steps


def _close(a: dict, b: dict, rtol: float) -> None:
    """Relative L2 distance over the whole model: elementwise, Adam turns last-bit
    differences on near-zero gradients into large relative changes of single elements."""
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    den = sum((b[k].double() ** 2).sum() for k in b)
    assert float((num / den).sqrt()) <= rtol


@pytest.mark.parametrize("stage", [1, 3])
def test_fused_step_trains_like_torch_adamw(stage):
    """Two param groups, clipping, an LR schedule: the fused kernel against torch's AdamW
    (the engine's path when the kernel does not apply), at world size 2."""
    fused = run_world(_train, 2, "triton", stage)[0]
    plain = run_world(_train, 2, "reference", stage)[0]
    assert fused[2] == 1  # one kernel call per param group (held on this rank) per step
    assert plain[2] == 0
    assert fused[0] == pytest.approx(plain[0], rel=1e-5)
    _close(fused[1], plain[1], rtol=1e-5)
    # torch's state layout and step counts, so checkpoints and state_dict() are unchanged.
    assert fused[3] == plain[3] == [("exp_avg", "exp_avg_sq", "step")]
    assert fused[4] == plain[4] == [float(STEPS)]


def test_fused_step_writes_the_fp16_compute_copy():
    """fp16 compute (loss scaling on): the kernel writes the compute copy in its pass."""
    fused = run_world(_train, 2, "triton", 3, "fp16")[0]
    plain = run_world(_train, 2, "reference", 3, "fp16")[0]
    assert fused[2] == 1
    assert fused[0] == pytest.approx(plain[0], rel=1e-3)
    _close(fused[1], plain[1], rtol=1e-3)


def test_fused_step_steps_aside_for_amsgrad():
    fused = run_world(_train, 2, "triton", 1, amsgrad=True)[0]
    assert fused[2] == 0
    assert fused[3] == [("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")]


def _train_dropping(rank: int, world: int, backend: str, stage: int):
    """test_step_counts' stack, blocks dropped alike on both ranks: the weights after each
    step, the optimizer state, and the fused kernel's launches per step."""
    from test_step_counts import _batch, _engine, _one_step

    engine = _engine(stage)
    weights = []
    with use_backend(backend):
        for step in range(STEPS_DROPPING):
            _one_step(engine, _batch(step, rank), step)
            weights.append(
                {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
            )
    state = engine.full_optimizer_state_dict(rank0_only=False)["state"]
    launches = engine.fused_step.launches
    engine.close()
    return weights, state, launches


STEPS_DROPPING = 6


@pytest.mark.parametrize("stage", [1, 3])
def test_the_fused_step_steps_beside_the_slices_stepped_by_parts(stage):
    """LayerDrop: the slices holding a dropped or lagging block are stepped by parts, with
    each block's own count (`optim/step_lag.py`); the fused kernel still steps the rest,
    every step after the first (before, one lagging slice turned it off for good). The
    weights at every step and the whole optimizer state, counts included, are torch's
    AdamW's on one process."""
    from test_step_counts import _assert_states_equal, _reference

    want_weights, want_states = _reference(2, steps=STEPS_DROPPING)
    for weights, state, launches in run_world(_train_dropping, 2, "triton", stage):
        if stage == 3:  # a slice a block: on every step some block is neither dropped
            # nor lagging. One param group, one launch a step, but the first: a slice's
            # first step, which makes its state, is torch's, whole, with the dropped
            # blocks put back after. (At stage 1 a rank's one slice spans the blocks.)
            assert launches == STEPS_DROPPING - 1
        for step, (got, want) in enumerate(zip(weights, want_weights)):
            for key, value in want.items():
                torch.testing.assert_close(
                    got[key], value, rtol=1e-5, atol=1e-6, msg=f"step {step} {key}"
                )
        _assert_states_equal(state, want_states[STEPS_DROPPING])
