"""torch's ZeroRedundancyOptimizer (DDP's ZeRO-1) handed to the engine trains as the
optimizer it wraps, and an LR scheduler built on it drives the steps."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

from distributed import run_world
from examples.gpt import decay_groups
from training import LR, local_batch, make_model
from zero_strategy import UnsupportedOptimizerError, ZeroConfig, ZeroEngine

STEPS = 4


def _train(rank: int, world: int, stage: int, wrapped: bool, name: str, offload: str):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    groups = decay_groups(model)
    cls = getattr(torch.optim, name)
    if wrapped:
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, lr=LR)
    else:
        optimizer = cls(groups, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    hooked = []  # a step hook of the user's, on the object it holds
    optimizer.register_step_post_hook(lambda opt, args, kwargs: hooked.append(opt is optimizer))
    directory = tempfile.mkdtemp() if offload == "disk" else None
    config = ZeroConfig(stage=stage, offload_optimizer=offload, offload_dir=directory)
    engine = ZeroEngine(model, optimizer, config)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = local_batch(step, 0, rank, world)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step(optimizer)
            optimizer.zero_grad()
            scheduler.step()
            losses.append(loss.item())
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    learning_rates = [group["lr"] for group in engine.optim.optimizer_set.param_groups]
    state = engine.full_state_dict()
    return {
        "losses": losses,
        "state": state if rank == 0 else None,
        "stepping": type(engine.optim.optimizers[0]).__name__,
        "hooked": hooked,
        "held": engine.optimizer is optimizer,
        "learning_rates": learning_rates,
        "scheduler_warnings": scheduler_warnings,
    }


@pytest.mark.parametrize(
    ("stage", "name", "offload"),
    [(1, "AdamW", "none"), (3, "AdamW", "none"), (1, "Adagrad", "none"), (2, "AdamW", "disk")],
)
def test_trains_as_the_optimizer_it_wraps_with_its_scheduler(stage, name, offload):
    """Adagrad makes its state when built; offload_optimizer="disk" steps in tiles, the
    user's hooks run around them."""
    wrapped = run_world(_train, 2, stage, True, name, offload)
    plain = run_world(_train, 2, stage, False, name, offload)
    for ours, theirs in zip(wrapped, plain):
        assert ours["losses"] == theirs["losses"]
        assert ours["stepping"] == name and ours["held"]
        assert ours["hooked"] == theirs["hooked"] == [True] * STEPS
        assert ours["learning_rates"] == [LR * 0.5**STEPS] * 2  # the scheduler's, applied
        assert ours["scheduler_warnings"] == theirs["scheduler_warnings"] == []
    for name, tensor in plain[0]["state"].items():
        torch.testing.assert_close(wrapped[0]["state"][name], tensor, rtol=0, atol=0)


def _overlapped(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=0.1
    )
    with pytest.raises(UnsupportedOptimizerError, match="overlap_with_ddp") as error:
        ZeroEngine(model, optimizer, ZeroConfig(stage=1))
    return str(error.value)


def _bucket_view(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, parameters_as_bucket_view=True
    )
    with pytest.raises(UnsupportedOptimizerError, match="without parameters_as_bucket_view"):
        ZeroEngine(model, optimizer, ZeroConfig(stage=3))


def test_parameters_as_bucket_view_is_refused():
    """Its buckets would hold a whole copy of the model on each rank."""
    run_world(_bucket_view, 2)


def test_overlap_with_ddp_is_refused_naming_the_fix():
    for message in run_world(_overlapped, 2):
        assert "torch.optim.AdamW(model.parameters()" in message


def _stepped_first(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1
    )
    x, y = local_batch(0, 0, rank, world)
    model(x, y).backward()
    optimizer.step()
    with pytest.raises(UnsupportedOptimizerError, match="stepped already"):
        ZeroEngine(model, optimizer, ZeroConfig(stage=1))


def test_one_that_stepped_before_is_refused():
    run_world(_stepped_first, 2)


def _lightning_fit(rank, world, strategy, tmp):
    from lightning_helpers import lit_module_class, loader, quiet_trainer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class WithZeroRedundancy(lit_module_class()):
        def configure_optimizers(self):
            optimizer = ZeroRedundancyOptimizer(
                decay_groups(self.model), optimizer_class=torch.optim.AdamW, lr=LR
            )
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    module = WithZeroRedundancy()
    trainer = quiet_trainer(world, strategy, max_steps=STEPS, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(n_batches=STEPS, world=world))
    trainer.save_checkpoint(f"{tmp}/{strategy}.ckpt")
    return {
        "losses": module.losses,
        "held": type(trainer.optimizers[0]).__name__,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
    }


def test_lightning_configure_optimizers_returning_one_trains_as_under_ddp(tmp_path):
    pytest.importorskip("lightning")
    ddp = run_world(_lightning_fit, 2, "ddp", str(tmp_path))
    for strategy in ("zero1", "zero3"):
        ours = run_world(_lightning_fit, 2, strategy, str(tmp_path))
        for rank in range(2):
            assert ours[rank]["held"] == "ZeroRedundancyOptimizer"
            assert len(ours[rank]["losses"]) == STEPS
            assert ours[rank]["lr"] == ddp[rank]["lr"] == LR * 0.5 ** (STEPS // 2)
            assert ours[rank]["scheduler_warnings"] == ddp[rank]["scheduler_warnings"]
            for a, b in zip(ours[rank]["losses"], ddp[rank]["losses"], strict=True):
                assert a == pytest.approx(b, rel=1e-5), (strategy, rank)


def _fabric_loop(rank, world, strategy, ckpt=None, resume=None):
    import os

    import lightning as L
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import zero_strategy  # noqa: F401

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    optimizer = ZeroRedundancyOptimizer(
        decay_groups(model), optimizer_class=torch.optim.AdamW, lr=LR
    )
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(resume, state)
    losses = []
    for step in range(state["step"], 2 * STEPS):
        x, y = local_batch(step, 0, rank, world)
        loss = model(x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        state["step"] = step + 1
        if ckpt and step + 1 == STEPS:
            fabric.save(ckpt, state)
    return losses


def test_fabric_setup_takes_one_and_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    ddp = run_world(_fabric_loop, 2, "ddp")
    ckpt = str(tmp_path / "ckpt")
    ours = run_world(_fabric_loop, 2, "zero3", ckpt)
    resumed = run_world(_fabric_loop, 2, "zero3", None, ckpt)
    for rank in range(2):
        assert ours[rank] == pytest.approx(ddp[rank], rel=1e-5)
        assert resumed[rank] == ours[rank][STEPS:]  # bit for bit


def _accelerate_loop(rank, world, wrapped: bool):
    import os

    from torch.distributed.optim import ZeroRedundancyOptimizer

    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=2), cpu=True)
    model = make_model()
    if wrapped:
        optimizer = ZeroRedundancyOptimizer(
            decay_groups(model), optimizer_class=torch.optim.AdamW, lr=LR
        )
    else:
        optimizer = torch.optim.AdamW(decay_groups(model), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    losses = []
    for step in range(STEPS):
        x, y = local_batch(step, 0, rank, world)
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.end_training()
    return losses


def test_accelerate_prepare_takes_one():
    """(Plain Accelerate cannot: its optimizer wrapper reads `state_dict()`, which a
    ZeroRedundancyOptimizer refuses before `consolidate_state_dict()`.)"""
    pytest.importorskip("accelerate")
    plain = run_world(_accelerate_loop, 2, False)
    ours = run_world(_accelerate_loop, 2, True)
    for rank in range(2):
        assert len(ours[rank]) == STEPS
        assert ours[rank] == plain[rank]


def _state_calls(rank, world, stage):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    optimizer = ZeroRedundancyOptimizer(
        decay_groups(model), optimizer_class=torch.optim.AdamW, lr=LR
    )
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    errors = {}
    for call, args in [
        ("consolidate_state_dict", (0,)),
        ("state_dict", ()),
        ("load_state_dict", ({},)),
    ]:
        try:
            getattr(optimizer, call)(*args)
        except RuntimeError as e:
            errors[call] = str(e)
    other = make_model()
    plain = torch.optim.AdamW(other.parameters(), lr=LR)  # any other optimizer: untouched
    ZeroEngine(other, plain, ZeroConfig(stage=stage)).close()
    engine.close()
    return errors, "state_dict" in vars(plain)


@pytest.mark.parametrize("stage", [1, 3])
def test_its_own_state_calls_are_refused_naming_the_engines_checkpoint(stage):
    """Under DDP a save calls consolidate_state_dict() then state_dict(); here they would
    hand out the never-stepped inner optimizer's empty state (a resume would restart the
    moments from zero without a word). Each raises, naming engine.save_checkpoint."""
    for errors, plain_touched in run_world(_state_calls, 2, stage):
        assert set(errors) == {"consolidate_state_dict", "state_dict", "load_state_dict"}
        for call, message in errors.items():
            assert f"ZeroRedundancyOptimizer.{call}()" in message
            assert "engine.save_checkpoint(dir)" in message
        assert not plain_touched
