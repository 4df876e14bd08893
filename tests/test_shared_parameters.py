"""One parameter stepped by two optimizers (Lightning's manual optimization with SGD and
Adam over the same weights): each optimizer keeps its own state of it, steps it as in one
process, skips it when its gradient was cleared by the other's zero_grad, and both states
are saved, resumed at another world size and stage, and consolidated."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from training import global_batch, local_batch, make_model, rel_l2
from zero_strategy import ZeroConfig, ZeroEngine

STEPS, CLIP = 6, 1.0


def _optimizers(model: torch.nn.Module):
    """Adam over the first two thirds of the parameters, SGD with momentum over the last
    two thirds: the middle third is in both."""
    params = list(model.parameters())
    third = len(params) // 3
    adam = torch.optim.Adam(params[: 2 * third], lr=3e-3)
    sgd = torch.optim.SGD(params[third:], lr=0.05, momentum=0.9)
    return adam, sgd


def _schedule(step: int, backward, step_optimizer, zero_grad, adam, sgd) -> None:
    """Adam steps every step, then clears its gradients; SGD then steps on a fresh
    backward (even steps), or at once (odd steps: the shared parameters have no gradient
    for it, the SGD-only ones keep theirs, as in one process). No gradient is left over
    at the end (a checkpoint holds none)."""
    backward(step, 0)
    step_optimizer(adam)
    zero_grad(adam)
    if step % 2 == 0:
        backward(step, 1)
    step_optimizer(sgd)
    zero_grad(sgd)
    zero_grad(adam)  # the second backward's gradients of the Adam-only parameters


def _reference(steps: range, state: dict | None = None):
    model = make_model()
    adam, sgd = _optimizers(model)
    if state is not None:
        model.load_state_dict(state["model"])
        adam.load_state_dict(state["adam"])
        sgd.load_state_dict(state["sgd"])

    def backward(step, micro):
        x, y = global_batch(step, micro)
        model(x, y).backward()

    def step_optimizer(opt):
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()

    for step in steps:
        _schedule(step, backward, step_optimizer, lambda o: o.zero_grad(), adam, sgd)
    return model, adam, sgd


def _train(rank, world, stage, steps, save=None, load=None, **config):
    model = make_model(seed=0 if load is None else 1)
    adam, sgd = _optimizers(model)
    names = {id(p): n for n, p in model.named_parameters()}
    adam_names = [names[id(p)] for p in adam.param_groups[0]["params"]]
    sgd_names = [names[id(p)] for p in sgd.param_groups[0]["params"]]
    config = ZeroConfig(stage=stage, gradient_clipping=CLIP, **config)
    engine = ZeroEngine(model, [adam, sgd], config)
    if load:
        engine.load_checkpoint(load)

    def backward(step, micro):
        x, y = local_batch(step, micro, rank, world)
        engine.backward(engine(x, y))

    for step in steps:
        _schedule(step, backward, engine.step, lambda o: engine.zero_grad(optimizer=o), adam, sgd)
    if save:
        engine.save_checkpoint(save)
    return {"state": engine.full_state_dict(), "adam": adam_names, "sgd": sgd_names}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_optimizers_over_one_parameter_train_as_one_process(stage):
    model, *_ = _reference(range(STEPS))
    expected = model.state_dict()
    ours = run_world(_train, 2, stage, range(STEPS))
    shared = set(ours[0]["adam"]) & set(ours[0]["sgd"])
    assert shared and set(ours[0]["adam"]) - shared and set(ours[0]["sgd"]) - shared
    assert rel_l2(ours[0]["state"], expected) <= 1e-5  # (rank 0 holds the whole state)
    untrained = make_model().state_dict()
    assert all(not torch.equal(ours[0]["state"][n], untrained[n]) for n in shared)


def test_optimizer_state_on_disk_steps_a_shared_parameter_tile_by_tile_as_one_process(tmp_path):
    """Each optimizer's state streamed from disk in small tiles (the views cut into
    pieces, each optimizer's apart): the same weights, and a checkpoint from it resumes
    in memory as training through."""
    disk = {"offload_optimizer": "disk", "offload_dir": str(tmp_path)}
    disk |= {"offload_tile_size": 700, "offload_buffer_count": 2}
    expected = _reference(range(STEPS))[0].state_dict()
    ours = run_world(_train, 2, 3, range(STEPS), **disk)
    assert rel_l2(ours[0]["state"], expected) <= 1e-5
    ckpt = str(tmp_path / "ckpt")
    run_world(_train, 2, 2, range(3), ckpt, **disk)
    resumed = run_world(_train, 2, 3, range(3, STEPS), None, ckpt)
    assert rel_l2(resumed[0]["state"], expected) <= 1e-5


def test_both_states_of_a_shared_parameter_resume_at_another_world_size_and_stage(tmp_path):
    """Saved by 2 ranks at stage 3 after 3 steps, resumed by 1 at stage 2 (and by 2 at
    stage 1): the rest equals training through, which needs SGD's momentum and Adam's
    moments of the shared parameters each restored."""
    ckpt = str(tmp_path / "ckpt")
    run_world(_train, 2, 3, range(3), ckpt)
    model, *_ = _reference(range(STEPS))
    expected = model.state_dict()
    for world, stage in ((1, 2), (2, 1)):
        resumed = run_world(_train, world, stage, range(3, STEPS), None, ckpt)
        assert rel_l2(resumed[0]["state"], expected) <= 1e-5, (world, stage)


def test_a_consolidated_checkpoint_holds_each_optimizers_state_of_a_shared_parameter(tmp_path):
    """The whole (Lightning) checkpoint lists, per optimizer, its own state of each of
    its parameters, as torch's optimizer.state_dict() of each would in one process."""
    from zero_strategy.checkpoint.consolidate import consolidate
    from zero_strategy.checkpoint.safe_load import safe_torch_load

    ckpt = str(tmp_path / "ckpt")
    names = run_world(_train, 2, 3, range(3), ckpt)[0]
    out = tmp_path / "whole.ckpt"
    consolidate(ckpt, out, fmt="lightning", with_optimizer=True, show_progress=False)
    whole = safe_torch_load(out)
    _, adam, sgd = _reference(range(3))
    for saved, opt, listed in zip(whole["optimizer_states"], (adam, sgd), ("adam", "sgd")):
        assert saved["param_groups"][0]["params"] == names[listed]
        reference = opt.state_dict()["state"]
        for position, name in enumerate(names[listed]):
            for key, value in reference[position].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert torch.allclose(saved["state"][name][key], value, atol=1e-6), (
                        name,
                        key,
                    )
    # ... and a resume from that one file trains on as through.
    expected = _reference(range(STEPS))[0].state_dict()
    resumed = run_world(_train, 2, 2, range(3, STEPS), None, str(out))
    assert rel_l2(resumed[0]["state"], expected) <= 1e-5


def test_an_ema_updated_at_every_step_is_refused_with_a_shared_parameter():
    model = make_model()
    with pytest.raises(ValueError, match=r"ema_decay.*stepped by two optimizers.*update_ema"):
        ZeroEngine(model, list(_optimizers(model)), ZeroConfig(stage=1, ema_decay=0.9))
