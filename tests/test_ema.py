"""The sharded EMA of the weights: the same average as torch's AveragedModel over
single-process training, at 1/N memory, saved and resumed at another stage, consolidated
on request."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.distributed import run_world
from tests.training import global_batch, local_batch, make_model, make_optimizer, rel_l2
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.checkpoint.consolidate import consolidate
from zero_strategy.checkpoint.safetensors_io import SafetensorsFile

DECAY = 0.8
STEPS = 6


def _reference(empty_steps: bool = False):
    """`AveragedModel` over single-process training; with `empty_steps`, each step is
    followed by one with no gradient since `zero_grad()` (torch steps nothing), the EMA
    updated after it too."""
    model = make_model()
    opt = make_optimizer(model)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    for step in range(STEPS):
        x, y = global_batch(step, 0)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
        if empty_steps:
            opt.step()
            ema.update_parameters(model)
    return {n: p.detach().clone() for n, p in ema.module.named_parameters()}


def _train(engine, steps, rank, world):
    for step in steps:
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()


def _optimizer_bytes(rank, world, stage, decay):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, ema_decay=decay))
    _train(engine, range(2), rank, world)
    shard = sum(v.hi - v.lo for v in engine.optim.views)
    held = engine.memory_report()["optimizer_state"]
    engine.close()
    return held, shard


def _ema_run(rank, world, stage, ckpt=None, resume=None, steps=range(STEPS)):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, ema_decay=DECAY))
    if resume:
        engine.load_checkpoint(resume)
    _train(engine, steps, rank, world)
    trained = engine.full_state_dict()
    with engine.ema_weights():
        averaged = engine.full_state_dict()
        x, y = local_batch(0, 0, rank, world)
        with torch.no_grad():
            ema_loss = engine(x, y).item()
    back = engine.full_state_dict()
    if ckpt:
        engine.save_checkpoint(ckpt)
    engine.close()
    return averaged, trained, back, ema_loss


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_ema_matches_averaged_model_over_single_process_training(reference, stage):
    results = run_world(_ema_run, 2, stage)
    averaged, trained, back, _ = results[0]
    assert rel_l2({n: averaged[n] for n in reference}, reference) < 1e-5
    assert rel_l2({n: trained[n] for n in reference}, reference) > 1e-3  # not the weights
    assert all(torch.equal(back[n], trained[n]) for n in trained)  # swapped back exactly


def test_the_ema_costs_one_fp32_shard_per_rank():
    """Exactly one fp32 value per element of this rank's shard, on top of Adam's state."""
    plain = run_world(_optimizer_bytes, 2, 3, 0.0)
    averaged = run_world(_optimizer_bytes, 2, 3, DECAY)
    for (without, shard), (held, same_shard) in zip(plain, averaged):
        assert shard == same_shard > 0
        assert held - without == 4 * shard


def test_ema_is_saved_resumed_at_another_stage_and_consolidated(tmp_path):
    whole = run_world(_ema_run, 2, 3)[0]
    ckpt, ckpt2 = str(tmp_path / "half"), str(tmp_path / "end")
    run_world(_ema_run, 2, 3, ckpt, None, range(3))
    resumed = run_world(_ema_run, 2, 1, ckpt2, ckpt, range(3, STEPS))[0]
    assert rel_l2(resumed[0], whole[0]) < 1e-6
    (written,) = consolidate(ckpt2, str(tmp_path / "ema"), weights="ema", show_progress=False)
    out = SafetensorsFile(written)
    for name, value in whole[0].items():
        torch.testing.assert_close(out.read(name), value, rtol=1e-5, atol=1e-7)


def test_consolidating_the_ema_of_a_checkpoint_without_one_names_the_fix(tmp_path):
    def save(rank, world, path):
        model = make_model()
        engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=2))
        _train(engine, range(1), rank, world)
        engine.save_checkpoint(path)
        engine.close()

    path = str(tmp_path / "plain")
    run_world(save, 2, path)
    with pytest.raises(ValueError, match=r"no EMA.*ema_decay"):
        consolidate(path, str(tmp_path / "out"), weights="ema", show_progress=False)


def test_update_before_the_first_step_is_refused():
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    with pytest.raises(RuntimeError, match=r"after engine\.step"):
        engine.update_ema(0.9)
    with pytest.raises(RuntimeError, match="no EMA to swap"):
        engine.swap_ema()


def _ema_with_empty_steps(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, ema_decay=DECAY))
    for step in range(STEPS):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
        engine.step()  # the engine skips every param group, and the EMA still follows
    with engine.ema_weights():
        averaged = engine.full_state_dict()
    engine.close()
    return averaged


@pytest.mark.parametrize("stage", [1, 3])
def test_the_ema_follows_a_step_that_has_no_gradient_to_take(stage):
    """A step with no gradient since `zero_grad()` changes no weight (torch skips the
    parameters), and the EMA folds the weights in all the same, as an `AveragedModel`
    updated after every `optimizer.step()` does."""
    reference = _reference(empty_steps=True)
    averaged = run_world(_ema_with_empty_steps, 2, stage)[0]
    assert rel_l2({n: averaged[n] for n in reference}, reference) < 1e-5
