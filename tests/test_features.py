"""Optimizers, frozen parameters, stage-3 options, evaluation and fp16 loss scaling."""

from __future__ import annotations

import pytest
import torch

from distributed import run_reference_world, run_world
from training import global_batch, local_batch, make_model
from zero_strategy import ZeroConfig, ZeroEngine

OPTIMIZERS = {
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda groups: torch.optim.Adam(groups, lr=1e-3, amsgrad=True),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
    "RMSprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5),
    "Adamax": lambda groups: torch.optim.Adamax(groups, lr=1e-3),
    "NAdam": lambda groups: torch.optim.NAdam(groups, lr=1e-3),
    "RAdam": lambda groups: torch.optim.RAdam(groups, lr=1e-3),
}


def _groups(model, lr_scale=0.5):
    """Two groups that differ in lr and weight decay, to show each stays exact."""
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2]
    others = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": matrices, "weight_decay": 0.01},
        {"params": others, "weight_decay": 0.0, "lr": 1e-3 * lr_scale},
    ]


def _train(rank, world, opt_name, stage, steps=5, frozen=False, **config):
    model = make_model()
    if frozen:
        model.blocks[0].requires_grad_(False)
    opt = OPTIMIZERS[opt_name](_groups(model))
    if world == 0:  # single-process reference
        for step in range(steps):
            x, y = global_batch(step, 0)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    if stage == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for step in range(steps):
            x, y = local_batch(step, 0, rank, world)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, **config))
    for step in range(steps):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    return engine.full_state_dict()


def _close(state, ref, tol):
    for k, v in ref.items():
        assert torch.allclose(state[k], v, rtol=tol, atol=tol), (k, (state[k] - v).abs().max())


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_every_elementwise_optimizer_with_two_groups(opt_name):
    """Bit-identical to DDP (same reductions, elementwise updates on 1-D views), and close
    to single-process training: Adagrad's tiny eps turns rounding-level gradients into
    lr-sized steps on a few elements, for DDP exactly as for ZeRO, hence the L2 check."""
    ref = _train(0, 0, opt_name, 3)
    ddp = run_world(_train, 2, opt_name, "ddp")[0]
    state = run_world(_train, 2, opt_name, 3)[0]
    for k, v in ddp.items():
        assert torch.equal(state[k], v), k
    num = sum(((state[k] - v).double() ** 2).sum() for k, v in ref.items())
    den = sum((v.double() ** 2).sum() for v in ref.values())
    assert (num / den).sqrt() < 1e-3  # DDP itself: 2e-4 for Adagrad


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_stay_frozen_and_the_rest_trains(stage):
    ref = _train(0, 0, "Adam", stage, frozen=True)
    state = run_world(_train, 2, "Adam", stage, frozen=True)[0]
    _close(state, ref, 1e-5)
    initial = make_model().state_dict()
    assert torch.equal(state["blocks.0.fc.weight"], initial["blocks.0.fc.weight"])
    assert not torch.equal(state["blocks.1.fc.weight"], initial["blocks.1.fc.weight"])


@pytest.mark.parametrize(
    "config",
    [
        {"prefetch_depth": 0},
        {"prefetch_depth": 3},
        {"persistence_threshold": 10_000_000},  # every unit stays gathered
        {"overlap_comm": False},
        {"unit_module_classes": ["Block", "CausalSelfAttention"]},
        {"bucket_size": 1000},
        {"max_reuse_distance": 10**9},  # gathered once per step
        {"max_reuse_distance": 10**9, "unit_module_classes": ["Block", "CausalSelfAttention"]},
    ],
)
def test_stage3_options_keep_training_exact(config):
    ref = _train(0, 0, "Adam", 3)
    state = run_world(_train, 2, "Adam", 3, **config)[0]
    _close(state, ref, 1e-5)


def _eval_frees(rank, world):
    model = make_model()
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    with torch.no_grad():
        loss = engine(x, y).item()
    gathered_after_eval = engine.memory_report()["gathered_parameters"]
    params_held = [p.untyped_storage().nbytes() for p in model.parameters()]
    return loss, gathered_after_eval, params_held


def test_stage3_evaluation_gathers_and_frees():
    for loss, gathered, sizes in run_world(_eval_frees, 2):
        assert 0 < loss < 10
        assert gathered == 0
        # sharded: nothing full is left (a freed parameter's one shared NaN element)
        assert sizes and all(n == 4 for n in sizes)


def _fp16_overflow(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        ZeroConfig(stage=stage, compute_dtype="fp16", initial_loss_scale_power=8),
    )
    # Only rank 1 overflows on the first step: every rank must skip it.
    poison = {"on": rank == 1}
    handle = model.blocks[0].fc.weight.register_hook(
        lambda g: g * float("inf") if poison["on"] else g
    )
    before = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    scales, stepped, losses = [], [], []
    for step in range(4):
        x, y = local_batch(step, 0, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        stepped.append(engine.step())
        engine.zero_grad()
        scales.append(engine.scaler.scale)
        losses.append(loss.item())
        if step == 0:
            after_skip = engine.full_state_dict(rank0_only=False)
            poison["on"] = False
    handle.remove()
    unchanged = all(torch.equal(before[k], after_skip[k]) for k in before)
    return stepped, scales, unchanged, losses


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    for stepped, scales, unchanged, losses in run_world(_fp16_overflow, 2, stage):
        assert stepped == [False, True, True, True]
        assert scales[0] == 128.0 and scales[1:] == [128.0, 128.0, 128.0]
        assert unchanged
        assert all(0 < v < 10 for v in losses)


CLEARS = {
    # what Lightning and most loops call: routed to engine.zero_grad()
    "optimizer.zero_grad": lambda opt: opt.zero_grad(),
    # what a wrapper's inherited zero_grad does (Fabric's): noticed before the next pass
    "Optimizer.zero_grad on the class": lambda opt: torch.optim.Optimizer.zero_grad(opt),
    # what Hugging Face's Trainer and many plain loops call
    "model.zero_grad": lambda model: model.zero_grad(),
}


@pytest.mark.parametrize("clear", sorted(CLEARS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_outside_the_engine_clears_its_gradients(stage, clear):
    """Gradients must not accumulate across steps whichever zero_grad the loop calls."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage))
    x, y = global_batch(0, 0)
    engine.backward(engine(x, y))
    engine.step()
    unit = engine.units[-1]
    first = unit.grad_opt.clone()
    assert float(first.abs().sum()) > 0
    CLEARS[clear](model if clear.startswith("model") else opt)
    if clear in ("optimizer.zero_grad", "model.zero_grad"):  # routed: cleared at once
        assert all(
            float(u.grad_opt.abs().sum()) == 0 for u in engine.units if u.grad_opt is not None
        )
    engine.backward(engine(x, y))
    engine.step()  # lr 0: same parameters, so the same gradient again, not twice it
    assert torch.equal(unit.grad_opt, first)


def _batchnorm_run(rank, world, mode, stage=1, **config):
    """Train a BatchNorm model on rank-dependent data, then evaluate on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)
    else:
        runner = ZeroEngine(model, opt, ZeroConfig(stage=stage, **config))
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 8, generator=g) * (1 + rank)  # ranks see different statistics
        runner(x).pow(2).mean().backward()
        if mode == "ddp":
            opt.step()
            opt.zero_grad()
        else:
            runner.step()
            runner.zero_grad()
    model.eval()
    with torch.no_grad():
        out = runner(torch.ones(2, 8))
    bn = model[1]
    return bn.running_mean.clone(), bn.running_var.clone(), out


@pytest.mark.parametrize("stage", [1, 3])
def test_buffers_follow_ddp_broadcast_buffers(stage):
    """After a training forward, the next forward starts from rank 0's BatchNorm statistics,
    as under DDP: every rank then evaluates as it would under DDP. (Parameters agree to
    the last bit or two on this model; the statistics differ by 0.07 without the sync.)"""
    ddp = run_reference_world(_batchnorm_run, 2, "ddp")
    ours = run_world(_batchnorm_run, 2, "zero", stage)
    for rank in range(2):
        for a, b in zip(ours[rank], ddp[rank]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    unsynced = run_world(_batchnorm_run, 2, "zero", stage, broadcast_buffers=False)
    assert not torch.equal(unsynced[1][0], ddp[1][0])  # without it rank 1 drifts


def _early_layers_frozen(rank, world, kind, stage=3, **config):
    """Each block's first layers (ln1, attention) frozen, the rest trained: backward still
    needs the frozen weights after the block's trainable gradients are in."""
    model = make_model()
    for block in model.blocks:
        for p in [*block.ln1.parameters(), *block.attn.parameters()]:
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if kind == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)
    else:
        runner = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, **config))
    losses, gathered = [], []
    for step in range(4):
        x, y = local_batch(step, 0, rank, world)
        loss = runner(x, y)
        loss.backward() if kind == "ddp" else runner.backward(loss)
        if kind != "ddp":
            gathered.append(runner.memory_report()["gathered_parameters"])
        optimizer.step() if kind == "ddp" else runner.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, gathered


@pytest.mark.parametrize("config", [{}, {"prefetch_depth": 0}, {"max_reuse_distance": 10**9}])
def test_frozen_layers_a_unit_uses_first_are_there_for_backward(config):
    """LoRA and partial fine-tuning freeze weights that backward needs after a unit's own
    gradients are in; the unit stays gathered until backward has left it."""
    ddp = run_reference_world(_early_layers_frozen, 2, "ddp")
    ours = run_world(_early_layers_frozen, 2, "zero", 3, **config)
    for (losses, gathered), (want, _) in zip(ours, ddp):
        assert losses == want
        assert gathered == [0] * len(gathered)  # nothing is left gathered after backward


def _tied_across_units(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(4, 4)
    model.tied_layer = torch.nn.Linear(4, 4)
    model.tied_layer.weight = model.layer.weight  # one weight, two sibling modules
    model.forward = lambda x: model.tied_layer(model.layer(x))
    engine = ZeroEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig(stage=3, unit_module_classes=["Linear"]),
    )
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    with engine.gathered_parameters():
        same = torch.equal(model.layer.weight, model.tied_layer.weight)
        shape = tuple(model.layer.weight.shape)
    engine.close()
    return same, shape


def test_a_weight_tied_across_two_units_lives_in_the_root_unit():
    """Lightning's memory-sharing test model: a weight shared by two sibling units is
    gathered with the unit that holds both (the root), and stays one tensor."""
    assert run_world(_tied_across_units, 2) == [(True, (4, 4))] * 2
