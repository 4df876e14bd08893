"""A parameter whose `.data` is replaced (ModelPruning's lottery-ticket reset,
`prune.remove`, a weight pinned by hand) keeps training from the written values, as under
DDP, at every stage: at stages 0-2 instead of losing the step's updates to a buffer the
module no longer reads, at stage 3 instead of the next gather putting the old values back."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_reference_world, run_world
from tests.training import local_batch, make_model, make_optimizer, step_and_state
from zero_strategy import ZeroConfig, ZeroEngine

WRITTEN = ("blocks.0.fc.weight", "blocks.1.attn.proj.bias")


def _written_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a lottery-ticket reset writes: the initial values (here: another seed's)."""
    fresh = dict(make_model(seed=7).named_parameters())
    return {name: fresh[name].detach() for name in WRITTEN}


def _train(rank, world, kind, stage, how, compute="fp32"):
    """Two steps, the written values, two more steps; the final parameters."""
    model = make_model()
    if kind == "ddp":
        engine = model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = make_optimizer(model)
        params = dict(model.module.named_parameters())
    else:
        optimizer = make_optimizer(model)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, compute_dtype=compute))
        params = dict(model.named_parameters())
    for step in range(4):
        if step == 2:
            values = _written_values(model)
            if how == "data":
                for name, value in values.items():
                    params[name].data = value.to(params[name].dtype).clone()
            else:  # the engine's own way to write weights
                with engine.gathered_parameters(modifier_rank=None), torch.no_grad():
                    for name, value in values.items():
                        params[name].copy_(value)
        step_and_state(engine, optimizer, engine(*local_batch(step, 0, rank, world)))
    if kind == "ddp":
        return {n: p.detach().clone() for n, p in params.items()}
    state = engine.full_state_dict(rank0_only=False)
    live = {n: p.detach().float().clone() for n, p in params.items()}
    engine.close()
    return state, live


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_replaced_data_trains_on_from_the_written_values_as_ddp(stage):
    ddp = run_reference_world(_train, 2, "ddp", None, "data")
    ours = run_world(_train, 2, "zero", stage, "data")
    for (state, live), reference in zip(ours, ddp):
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
            if stage < 3:  # (stage 3 holds no whole parameter between steps)
                torch.testing.assert_close(live[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replaced_data_in_bf16_equals_a_write_through_gathered_parameters(stage):
    written = run_world(_train, 2, "zero", stage, "gathered", "bf16")
    replaced = run_world(_train, 2, "zero", stage, "data", "bf16")
    for (state, live), (want_state, want_live) in zip(replaced, written):
        for name in want_state:
            assert torch.equal(state[name], want_state[name]), name
        for name in want_live if stage < 3 else ():
            assert torch.equal(live[name], want_live[name]), name


def _wrong_shape(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    model.blocks[0].fc.weight.data = torch.zeros(3, 3)
    try:
        engine(*local_batch(0, 0, rank, world))
    except ValueError as error:
        return str(error)
    finally:
        engine.close()
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_replaced_data_of_another_shape_is_refused_naming_the_parameter(stage):
    for message in run_world(_wrong_shape, 2, stage):
        assert "blocks.0.fc.weight" in message and "(3, 3)" in message
        assert "same shape" in message


def _saved_right_after(rank, world, stage, tmp):
    """Written by `.data`, then saved and consolidated before any forward or step (a
    callback's write at on_train_end, a checkpoint next): both hold the written values."""
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    engine.backward(engine(*local_batch(0, 0, rank, world)))
    engine.step()
    values = _written_values(model)
    params = dict(model.named_parameters())
    for name, value in values.items():
        params[name].data = value.clone()
    state = engine.full_state_dict(rank0_only=False)
    engine.save_checkpoint(tmp)
    engine.close()
    model = make_model(seed=3)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    engine.load_checkpoint(tmp)
    loaded = engine.full_state_dict(rank0_only=False)
    engine.close()
    return [(state[n], loaded[n], v) for n, v in values.items()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_values_written_by_data_reach_a_checkpoint_taken_before_any_forward(stage, tmp_path):
    for rank in run_world(_saved_right_after, 2, stage, str(tmp_path / "ck")):
        for state, loaded, written in rank:
            assert torch.equal(state, written) and torch.equal(loaded, written)


def _other_dtype(rank, world, stage):
    """A bf16 model converted to fp32 after a step (its `wpe` frozen from the start): what
    two evaluation forwards warn, then what a training forward raises."""
    import warnings

    model = make_model()
    model.wpe.weight.requires_grad_(False)
    config = ZeroConfig(stage=stage, compute_dtype="bf16")
    engine = ZeroEngine(model, make_optimizer(model), config)
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.float()  # converted after the hand-over
        with torch.no_grad():
            for _ in range(2):
                engine(x, y)
        try:
            engine(x, y)
            refused = ""
        except ValueError as e:
            refused = str(e)
    engine.close()
    return [str(w.message) for w in caught if "dtype" in str(w.message)], refused


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_converted_to_another_dtype_is_named_in_evaluation_and_refused_in_training(stage):
    """`model.float()` (or `.half()`) after the engine took the model: an evaluation
    forward warns once, naming the parameters; at stages 0-2 a training forward is
    refused, naming the trained ones and the fix (compute_dtype). Before, the steps at
    stage 2 silently stopped reaching the weights, and stages 0-1 failed in backward on
    torch's gradient dtype check. At stage 3 the engine's values are shown again at the
    first look (the warning says the conversion is ignored), and training goes on."""
    for said, refused in run_world(_other_dtype, 2, stage):
        assert len(said) == 1 and "blocks.0.fc.weight" in said[0]
        assert "torch.bfloat16" in said[0]
        if stage == 3:
            assert refused == "" and "ignored" in said[0]
            continue
        assert "blocks.0.fc.weight" in refused and "compute_dtype" in refused
        assert "wpe.weight" not in refused  # frozen: no step to lose
