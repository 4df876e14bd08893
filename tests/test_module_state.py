"""`model.state_dict()` and `model.load_state_dict()` on the engine's module mean what they
mean on an unsharded model, at every stage and compute dtype."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine

CASES = [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _step(engine, rank, world, step):
    x, y = local_batch(step, 0, rank, world)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.detach()


def _state_dict_after_training(rank, world, stage, compute):
    model = make_model()
    cfg = ZeroConfig(stage=stage, compute_dtype=compute, overlap_param_gather=True)
    engine = ZeroEngine(model, make_optimizer(model), cfg)
    for step in range(3):
        _step(engine, rank, world, step)
    gathered_before = engine.memory_report()["gathered_parameters"]
    sd = model.state_dict()  # straight after a step: stage 1-2 gathers may be in flight
    child = model.blocks[1].attn.state_dict()  # a module inside a stage-3 unit
    gathered_after = engine.memory_report()["gathered_parameters"]
    masters = engine.full_state_dict(rank0_only=False)
    return sd, child, masters, gathered_before, gathered_after


@pytest.mark.parametrize("stage,compute", CASES)
def test_state_dict_holds_the_full_trained_values(stage, compute):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[compute]
    for sd, child, masters, before, after in run_world(
        _state_dict_after_training, 2, stage, compute
    ):
        assert sd.keys() == masters.keys()
        for name, value in sd.items():
            expected = masters[name]
            if value.is_floating_point() and expected.dtype != value.dtype:
                expected = expected.to(dtype)  # the compute copy is the rounded master
            assert value.shape == expected.shape, name
            assert torch.equal(value, expected), name
        for name, value in child.items():
            assert torch.equal(value, sd[f"blocks.1.attn.{name}"]), name
        assert after == before  # what the call gathered, it freed


def _load_then_train(rank, world, stage, compute):
    model = make_model(seed=0)
    cfg = ZeroConfig(stage=stage, compute_dtype=compute)
    engine = ZeroEngine(model, make_optimizer(model), cfg)
    _step(engine, rank, world, 0)
    # Load another model's weights mid-run, as a user restoring a pretrained backbone.
    donor = make_model(seed=1).state_dict()
    result = model.load_state_dict(donor)
    masters = engine.full_state_dict(rank0_only=False)
    loss = _step(engine, rank, world, 1).float()
    torch.distributed.all_reduce(loss)
    keys = (list(result.missing_keys), list(result.unexpected_keys))
    return keys, donor, masters, loss.item() / world


def _reference_from_donor(world):
    """The donor's loss on step 1's global batch, as the mean of the ranks' losses."""
    model = make_model(seed=1)
    with torch.no_grad():
        return sum(model(*local_batch(1, 0, r, world)).item() for r in range(world)) / world


@pytest.mark.parametrize("stage,compute", CASES)
def test_load_state_dict_reaches_the_shards_and_the_masters(stage, compute):
    results = run_world(_load_then_train, 2, stage, compute)
    reference = _reference_from_donor(2)
    for (missing, unexpected), donor, masters, loss in results:
        assert not missing and not unexpected
        for name, value in donor.items():
            # fp32 masters take the loaded values at full precision, also under bf16.
            assert torch.equal(masters[name], value), name
        # The first step after the load starts from the donor's weights.
        tolerance = 1e-6 if compute == "fp32" else 2e-2
        assert loss == pytest.approx(reference, rel=tolerance)


def _partial_load(rank, world, stage, compute):
    model = make_model(seed=0)
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=stage, compute_dtype=compute)
    )
    _step(engine, rank, world, 0)
    before = engine.full_state_dict(rank0_only=False)
    head = {"weight": make_model(seed=1).blocks[1].fc.weight.detach().clone()}
    model.blocks[1].fc.load_state_dict(head, strict=False)  # the bias is not in the dict
    return before, engine.full_state_dict(rank0_only=False), head["weight"]


@pytest.mark.parametrize("stage,compute", [(2, "bf16"), (3, "bf16"), (3, "fp32")])
def test_a_partial_load_changes_only_what_it_loads(stage, compute):
    """load_state_dict(strict=False) of some entries: those reach the masters exactly;
    every other master is untouched (not re-rounded through the compute dtype)."""
    for before, after, loaded in run_world(_partial_load, 2, stage, compute):
        assert torch.equal(after["blocks.1.fc.weight"], loaded)
        for name, value in before.items():
            if name != "blocks.1.fc.weight":
                assert torch.equal(after[name], value), name
