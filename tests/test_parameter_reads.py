"""Stage 3: a parameter read by name outside forward is gathered when its values are used
(FSDP2's DTensor parameters run the collective an op needs and read their metadata
locally; here the owning module's attribute read marks the parameter). Reads equal the
masters, writes made after a read are kept as under DDP, a step or a load drops what a
read gathered, tied weights compare equal, deep copies stay plain, a metadata read on one
rank is local, and a value read on one rank alone is an error, not a hang."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from tests.distributed import run_world
from tests.training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine


def _engine(**config) -> ZeroEngine:
    model = make_model()
    return ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, **config))


def _one_step(engine: ZeroEngine, rank: int, world: int, step: int = 0) -> None:
    x, y = local_batch(step, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()


def _read_after_steps(rank, world, compute_dtype):
    engine = _engine(compute_dtype=compute_dtype)
    block = engine.module.blocks[1]
    held_before = engine.memory_report()["gathered_parameters"]
    first = block.fc.weight.detach().clone()  # before any step: the initial values
    held_by_read = engine.memory_report()["gathered_parameters"] - held_before
    _one_step(engine, rank, world)
    held_after_step = engine.memory_report()["gathered_parameters"] - held_before
    stepped = block.fc.weight.detach().clone()
    masters = engine.full_state_dict(rank0_only=False)
    _one_step(engine, rank, world, step=1)  # the read unit is used, then freed by backward
    held_after_use = engine.memory_report()["gathered_parameters"] - held_before
    engine.close()
    unit_bytes = sum(p.numel() for p in make_model().blocks[1].parameters()) * (
        2 if compute_dtype == "bf16" else 4
    )
    return {
        "initial": torch.equal(first, make_model().blocks[1].fc.weight.to(first.dtype)),
        "stepped": torch.equal(stepped, masters["blocks.1.fc.weight"].to(stepped.dtype)),
        "moved": not torch.equal(first, stepped),
        "held_by_read": held_by_read,
        "unit_bytes": unit_bytes,
        "held_after_step": held_after_step,
        "held_after_use": held_after_use,
    }


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_a_parameter_read_outside_forward_shows_the_current_values(compute_dtype):
    for got in run_world(_read_after_steps, 2, compute_dtype):
        assert got["initial"] and got["stepped"] and got["moved"]
        # The read holds the unit's block whole (padding aside); a step frees it, and a
        # unit gathered again by a read is freed by its next backward.
        assert got["unit_bytes"] <= got["held_by_read"] < got["unit_bytes"] + 64
        assert got["held_after_step"] == got["held_after_use"] == 0


def _written_after_read(rank, world, write_before_step):
    engine = _engine()
    reference = make_model()
    ref_opt = make_optimizer(reference)
    for step in range(2):
        if write_before_step == step:
            for model in (engine.module, reference):
                with torch.no_grad():
                    model.blocks[0].fc.bias.fill_(0.25)  # a read, then a write in place
        _one_step(engine, rank, world, step)
        x, y = local_batch(step, 0, 0, 1)  # the whole global batch on one process
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    ours = engine.full_state_dict(rank0_only=False)
    engine.close()
    # atol: Adam's update of near-zero gradients (the query/key biases) is float noise;
    # a write lost would be off by the 0.25 written.
    return {
        n: torch.allclose(ours[n], p, rtol=1e-5, atol=1e-5) for n, p in reference.named_parameters()
    }


@pytest.mark.parametrize("write_before_step", [0, 1])
def test_a_write_after_a_read_is_kept_as_under_ddp(write_before_step):
    for same in run_world(_written_after_read, 2, write_before_step):
        assert all(same.values()), [n for n, ok in same.items() if not ok]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(32, 2)
        self.tied = nn.Linear(32, 2)
        self.tied.weight = self.layer.weight
        self.other = nn.Linear(2, 2)

    def forward(self, x):
        return self.other(self.layer(x) + self.tied(x))


def _tied_and_copied(rank, world):
    model = _Tied()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    equal = torch.equal(model.layer.weight, model.tied.weight)
    same_memory = model.layer.weight.data_ptr() == model.tied.weight.data_ptr()
    finite = bool(model.other.weight.isfinite().all())
    clone = copy.deepcopy(model)  # an EMA copy: plain modules, whose reads stay local
    engine.reset_comm_report()
    if rank == 0:
        clone.other.weight.sum()
    quiet = engine.comm_report() == {}
    released = engine.release_module()
    plain = type(released.layer) is nn.Linear and type(clone.other) is nn.Linear
    return equal, same_memory, finite, quiet, plain


def test_tied_weights_compare_equal_and_a_deep_copy_stays_plain():
    for equal, same_memory, finite, quiet, plain in run_world(_tied_and_copied, 2):
        assert equal and same_memory and finite and quiet and plain


def _read_on_one_rank(rank, world):
    engine = _engine(collective_timeout=30)
    if rank == 0:
        engine.module.blocks[1].fc.weight.sum()  # rank 1 goes on to the next forward
    _one_step(engine, rank, world)
    engine.close()


def test_a_read_on_one_rank_alone_is_an_error_not_a_hang():
    results = run_world(_read_on_one_rank, 2, expect_errors=True, timeout=120)
    assert all(status == "error" for status, _ in results), results
    assert all("ModulePathDivergenceError" in str(payload) for _, payload in results)
    assert any("Reading a parameter's values outside forward" in str(p) for _, p in results)


def _metadata_on_one_rank(rank, world):
    engine = _engine(collective_timeout=30)
    _one_step(engine, rank, world)
    held_before = engine.memory_report()["gathered_parameters"]
    seen = None
    if rank == 0:  # as DDP code logs a shape on rank 0: local, as FSDP2's DTensor shape
        weight = engine.module.blocks[1].fc.weight
        seen = (
            tuple(weight.shape),
            weight.dtype,
            weight.device.type,
            weight.numel(),
            weight.size(0),
            weight.dim(),
            weight.requires_grad,
            weight.grad is None,
        )
        held = engine.memory_report()["gathered_parameters"] - held_before
    _one_step(engine, rank, world, step=1)  # the ranks' next gathers agree: no error
    released = engine.release_module()
    plain = rank != 0 or (type(weight) is nn.Parameter and weight.isfinite().all())
    plain = plain and all(type(p) is nn.Parameter for p in released.parameters())
    return seen, held if rank == 0 else 0, plain


def test_a_metadata_read_on_one_rank_alone_is_local():
    reference = make_model().blocks[1].fc.weight
    (seen, held, plain), (_, _, other_plain) = run_world(_metadata_on_one_rank, 2)
    shape = tuple(reference.shape)
    assert seen == (shape, torch.float32, "cpu", reference.numel(), shape[0], 2, True, True)
    assert held == 0  # nothing gathered for it
    assert plain and other_plain


def _reads_with_int8_gathers(rank, world):
    """Each rank its own node (LOCAL_WORLD_SIZE=1): every gather goes int8 over the
    link, so what a read gathers is the masters rounded to their blocks' grid."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    model = make_model()
    optimizer = make_optimizer(model)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, quantized_weights=True))
    for step in range(2):
        engine.module.blocks[0].fc.weight.sum()  # a read, then the step
        _one_step(engine, rank, world, step)
        engine.module.blocks[1].fc.weight.sum()  # a read, then a save reads the masters
        state = engine.full_state_dict(rank0_only=False)
    engine.close()
    initial = make_model().state_dict()
    return all(torch.equal(state[k], initial[k]) for k in state)


def test_reads_never_write_a_quantized_gather_into_the_masters():
    """lr=0: the masters come out as they went in, though each read gathered int8
    copies (only what code writes goes back)."""
    assert run_world(_reads_with_int8_gathers, 2) == [True, True]


def _written_then_saved(rank, world):
    engine = _engine()
    with torch.no_grad():
        engine.module.blocks[0].fc.bias.fill_(0.25)
    state = engine.full_state_dict(rank0_only=False)  # before any free or step
    engine.close()
    return bool((state["blocks.0.fc.bias"] == 0.25).all())


def test_a_write_after_a_read_is_in_the_next_state_dict():
    assert run_world(_written_then_saved, 2) == [True, True]


class _Norm(nn.Module):
    """As Transformers' RMSNorm: its repr reads the weight's shape."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}"


def _parameter_printed_on_rank_0(rank, world):
    engine = _engine(collective_timeout=30)
    _one_step(engine, rank, world)
    printed = f"{engine.module.blocks[1].fc.weight}" if rank == 0 else ""
    _one_step(engine, rank, world, step=1)  # the ranks' next gathers agree: no error
    with engine.gathered_parameters():
        whole = repr(engine.module.blocks[1].fc.weight)
    engine.close()
    return printed, whole


def test_printing_a_parameter_on_one_rank_is_local():
    """As a DTensor's repr: a debug print on rank 0 alone is no collective; it says where
    the values are. Whole (inside gathered_parameters()), it prints them."""
    (printed, whole), _ = run_world(_parameter_printed_on_rank_0, 2)
    shape = tuple(make_model().blocks[1].fc.weight.shape)
    assert printed.startswith(f"Parameter(shape={shape}, dtype=torch.float32")
    assert "an op or .data on every rank gathers them" in printed
    assert whole.startswith("Parameter containing:\ntensor([[") and "nan" not in whole


def _printed_on_rank_0(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Norm(8), nn.Linear(8, 1))
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    printed = repr(model) if rank == 0 else ""
    engine.backward(engine(torch.ones(2, 8)).sum())  # the ranks' next gathers agree
    engine.step()
    engine.close()
    return printed


def test_printing_the_model_on_one_rank_gathers_nothing():
    printed, _ = run_world(_printed_on_rank_0, 2)
    assert "Linear(in_features=8, out_features=8, bias=True)" in printed
    assert "_Norm((8,))" in printed


def _ema_by_hand(rank, world):
    """An EMA kept over `model.parameters()` after each step, as DDP code keeps one: the
    iteration goes around attribute access, and each value read gathers its unit. The
    same EMA over the masters (a state dict) is the exact reference."""
    engine = _engine()
    names = [name for name, _ in engine.module.named_parameters()]
    averages = [p.detach().clone() for p in make_model().parameters()]
    from_masters = [a.clone() for a in averages]
    for step in range(3):
        _one_step(engine, rank, world, step)
        with torch.no_grad():
            for average, p in zip(averages, engine.module.parameters()):
                average.mul_(0.5).add_(p.detach(), alpha=0.5)
        masters = engine.full_state_dict(rank0_only=False)
        for average, name in zip(from_masters, names):
            average.mul_(0.5).add_(masters[name], alpha=0.5)
    plain = all(type(p) is nn.Parameter for p in engine.release_module().parameters())
    return [torch.equal(a, b) for a, b in zip(averages, from_masters)], plain


def test_values_read_through_model_parameters_are_the_current_ones():
    for equal, plain in run_world(_ema_by_hand, 2):
        assert equal and all(equal)
        assert plain
