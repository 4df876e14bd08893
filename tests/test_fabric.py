"""Fabric(strategy="zero3"): the same loop as under DDP gives the same losses."""

from __future__ import annotations

import os

import pytest

from distributed import run_world
from training import local_batch, make_model, make_optimizer

L = pytest.importorskip("lightning")


def _loop(
    rank, world, strategy, steps=10, ckpt=None, resume=None, precision="32-true", split=False
):
    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()  # ranks already exist (as under torchrun): this only sets up
    model = make_model()
    if split:  # the model first, then an optimizer built from the set-up model
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(resume, state)
    losses = []
    for step in range(state["step"], steps):
        for micro in range(2):
            x, y = local_batch(step, micro, rank, world)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(x, y) / 2
                fabric.backward(loss)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if ckpt and step + 1 == steps // 2:
            fabric.save(ckpt.format(rank=rank), state)  # "{rank}": a path per rank
    return losses


def test_fabric_zero3_matches_ddp():
    ddp = run_world(_loop, 2, "ddp")
    ours = run_world(_loop, 2, "zero3")
    for a, b in zip(ours, ddp):
        assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True))


def _optimizer_state_after_steps(rank, world, strategy):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model))
    for step in range(2):
        fabric.backward(model(*local_batch(step, 0, rank, world)))
        optimizer.step()
        optimizer.zero_grad()
    return fabric.strategy.get_optimizer_state(optimizer)


def test_fabric_get_optimizer_state_is_ddps_on_rank_0():
    """`fabric.strategy.get_optimizer_state(optimizer)`: torch's state dict of the whole
    optimizer on rank 0 (empty elsewhere), as DDP's, not this rank's shards."""
    ddp = run_world(_optimizer_state_after_steps, 2, "ddp")
    ours, rest = run_world(_optimizer_state_after_steps, 2, "zero3")
    assert rest == {}
    assert ours["param_groups"] == ddp[0]["param_groups"]
    import torch

    torch.testing.assert_close(ours["state"], ddp[0]["state"], rtol=1e-4, atol=1e-7)


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_world(_loop, 2, "zero3", 10, ckpt)
    resumed = run_world(_loop, 2, "zero3", 10, None, ckpt)
    for a, b in zip(resumed, full):
        assert a == b[10:]


def test_fabric_save_to_paths_that_differ_by_rank_writes_rank_0s(tmp_path):
    """As Fabric's FSDP strategy: every rank writes rank 0's path."""
    full = run_world(_loop, 2, "zero3", 10, str(tmp_path / "rank{rank}" / "ckpt"))
    assert not (tmp_path / "rank1").exists()
    resumed = run_world(_loop, 2, "zero3", 10, None, str(tmp_path / "rank0" / "ckpt"))
    for a, b in zip(resumed, full):
        assert a == b[10:]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fabric_low_precision_stays_close_to_fp32(precision):
    """bf16 keeps 8 significant bits; with fp32 masters and loss the losses stay within
    2e-2 of fp32 over 6 steps."""
    fp32 = run_world(_loop, 2, "zero3", 6)
    low = run_world(_loop, 2, "zero3", 6, None, None, precision)
    for a, b in zip(low, fp32):
        assert all(abs(x - y) <= 2e-2 * abs(y) for x, y in zip(a, b, strict=True))


def _load_model_only(rank, world, ckpt):
    import torch

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    fabric.launch()
    model = make_model(seed=1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.load(ckpt, {"model": model})  # no optimizer: the trained AdamW state is not read
    x, y = local_batch(5, 0, rank, world)
    with torch.no_grad():
        return model(x, y).item(), len(optimizer.state)


def test_fabric_loads_the_model_alone_into_another_optimizer(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_world(_loop, 2, "zero3", 10, ckpt)  # saved after step 5
    for (loss, sgd_state), trained in zip(run_world(_load_model_only, 2, ckpt), full):
        assert loss / 2 == trained[10]  # step 5, first micro-batch (halved there), same weights
        assert sgd_state == 0


def test_setup_module_then_setup_optimizers_trains_the_same():
    """Fabric's FSDP-style order (model, then an optimizer over its parameters) shards at
    setup_optimizers and trains exactly as fabric.setup(model, optimizer)."""
    together = run_world(_loop, 2, "zero3", 4)
    split = run_world(_loop, 2, "zero3", 4, split=True)
    assert split == together


def _evaluate_and_teach(rank, world, ckpt):
    import torch

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    fabric.launch()
    # Evaluation only: no optimizer; fabric.load shards the model and reads its weights.
    evaluated = fabric.setup(make_model(seed=1))
    fabric.load(ckpt, {"model": evaluated})
    x, y = local_batch(5, 0, rank, world)
    with torch.no_grad():
        loss = evaluated(x, y).item()
    # Two models pending: the optimizer decides which one is sharded.
    other = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    other.launch()
    student = other.setup_module(make_model(seed=2))
    teacher = other.setup(make_model(seed=3))  # no optimizer: replicated
    other.setup_optimizers(make_optimizer(student))
    sharded = other.strategy.engine.module
    return loss, sharded is student.module, teacher(x, y).item() > 0


def test_evaluation_models_and_the_optimizer_choosing_the_model(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_world(_loop, 2, "zero3", 10, ckpt)  # saved after step 5
    for (loss, student_sharded, teacher_ran), trained in zip(
        run_world(_evaluate_and_teach, 2, ckpt), full
    ):
        assert loss / 2 == trained[10]
        assert student_sharded and teacher_ran


def _init_module_and_load_raw(rank, world, raw):
    import torch

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    fabric.launch()
    with fabric.init_module(empty_init=True):  # litgpt's way: never the whole model
        model = make_model()
    on_meta = all(p.is_meta for p in model.parameters())
    try:  # Fabric refuses an optimizer over meta parameters after setup_module
        fabric.setup_module(model)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    model, optimizer = fabric.setup(model, make_optimizer(model))
    engine = fabric.strategy.engine
    shard_bytes = sum(u.layout.shard_numel for u in engine.units) * 4
    held = engine.memory_report()["parameters"]
    fabric.load_raw(raw, model)  # a plain full state dict, every rank
    x, y = local_batch(0, 0, rank, world)
    with torch.no_grad():
        loss = model(x, y).item()
    loss_before = model(x, y)
    fabric.backward(loss_before)
    optimizer.step()
    return on_meta, held == shard_bytes, loss, refused


def test_init_module_on_meta_and_load_raw_of_a_full_state_dict(tmp_path):
    """fabric.init_module(empty_init=True) builds on the meta device and each rank holds
    only its shard after fabric.setup(model, optimizer) (setup_module alone is refused with
    that fix); fabric.load_raw then fills the sharded model from a full state dict."""
    import torch

    reference = make_model(seed=4)
    raw = str(tmp_path / "model.pt")
    torch.save(reference.state_dict(), raw)
    with torch.no_grad():
        want = [reference(*local_batch(0, 0, r, 2)).item() for r in range(2)]
    for rank, (on_meta, holds_shard, loss, refused) in enumerate(
        run_world(_init_module_and_load_raw, 2, raw)
    ):
        assert on_meta and holds_shard
        assert "fabric.setup(model, optimizer)" in refused
        assert loss == pytest.approx(want[rank], rel=1e-6)


def _model_only(rank, world, strategy, ckpt):
    import torch

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_model(seed=1))
    fabric.save(ckpt, {"model": model})  # before it has an optimizer
    optimizer = fabric.setup_optimizers(make_optimizer(model))  # then trained with one
    losses = []
    for step in range(3):
        x, y = local_batch(step, 0, rank, world)
        loss = model(x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    other = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    other.launch()
    fresh = other.setup_module(make_model(seed=2))
    other.load(ckpt, {"model": fresh})  # the weights saved before training
    x, y = local_batch(0, 0, rank, world)
    with torch.no_grad():
        first = fresh(x, y).item()
    return losses, first


def test_model_set_up_without_an_optimizer_saves_loads_and_then_trains(tmp_path):
    ddp = run_world(_model_only, 2, "ddp", str(tmp_path / "ddp.ckpt"))
    ours = run_world(_model_only, 2, "zero3", str(tmp_path / "zero3"))
    for (losses, first), (ddp_losses, ddp_first) in zip(ours, ddp):
        assert first == losses[0]  # the saved weights are the untrained ones
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ddp_losses))
        assert abs(first - ddp_first) <= 1e-6 * abs(ddp_first)


def _ema(rank, world, strategy):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    import zero_strategy  # noqa: F401
    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    if strategy != "ddp":  # the sharded EMA, as any ZeroConfig field
        strategy = ZeroFabricStrategy(stage=3, ema_decay=0.8)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model))
    average = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    for step in range(4):
        x, y = local_batch(step, 0, rank, world)
        fabric.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
        if strategy == "ddp":
            average.update_parameters(model.module)
    if strategy == "ddp":
        return {n: p.detach().clone() for n, p in average.module.named_parameters()}
    engine = fabric.strategy.engine
    with engine.ema_weights(), engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_fabric_sharded_ema_matches_an_averaged_model_under_ddp():
    import torch

    for ours, ddp in zip(run_world(_ema, 2, "zero3"), run_world(_ema, 2, "ddp")):
        for name, value in ddp.items():
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6)


def _save_load_around_setup(rank, world, strategy, tmp):
    """Lightning's own Fabric DDP save/load test: a model saved before and after
    setup (no optimizer), loaded into a plain model and into a set-up one."""
    import contextlib
    from copy import deepcopy
    from pathlib import Path

    import torch

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    tmp = Path(tmp)
    model = make_model(seed=4)
    before = {n: p.detach().clone() for n, p in deepcopy(model).named_parameters()}
    fabric.save(tmp / "before_setup", {"model": model})
    wrapped = fabric.setup(model)
    fabric.save(tmp / "after_setup", {"model": wrapped})

    def same(module) -> bool:
        engine = getattr(fabric.strategy, "engine", None)
        managed = engine is not None and engine.manages(next(module.parameters()))
        with engine.gathered_parameters() if managed else contextlib.nullcontext():
            return all(torch.equal(before[n], p.detach()) for n, p in module.named_parameters())

    results = []
    plain = make_model(seed=5)
    for name in ("before_setup", "after_setup"):
        fabric.load(tmp / name, {"model": plain})
        results.append(same(plain))
    other = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    other.launch()
    set_up = other.setup(make_model(seed=6))
    fabric = other
    for name in ("before_setup", "after_setup"):
        other.load(tmp / name, {"model": set_up})
        results.append(same(set_up.module))
    return results


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fabric_save_and_load_before_and_after_setup(tmp_path, strategy):
    for results in run_world(_save_load_around_setup, 2, strategy, str(tmp_path)):
        assert results == [True, True, True, True]
