"""`state_dict_type="full"`: each checkpoint is one torch file, every rank writing its own
ranges of it, that Lightning's loaders, `torch.load(weights_only=True)`,
a plain optimizer and a resume at another stage all open."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_world

pytest.importorskip("lightning")

from lightning_helpers import fit, lit_module_class, loader, quiet_trainer

from training import TINY, local_batch, make_model, make_optimizer


def _strategy(stage: int, state_dict_type: str = "full"):
    from zero_strategy.integrations.lightning import ZeroStrategy

    return ZeroStrategy(stage=stage, state_dict_type=state_dict_type)


def _probe() -> torch.Tensor:
    return torch.arange(2 * TINY.block_size).reshape(2, -1) % TINY.vocab_size


def _fit_and_save(rank, world, path):
    """Five steps at stage 3, saved whole; the model's logits on a probe batch."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    trainer = quiet_trainer(world, _strategy(3), max_steps=5, num_sanity_val_steps=0)
    module = lit_module_class()()
    trainer.fit(module, loader(n_batches=5, world=world))
    trainer.save_checkpoint(path)
    with torch.no_grad(), trainer.strategy.engine.gathered_parameters():
        logits = module.model.eval()(_probe())
    # trainer.validate(ckpt_path=...) in a fresh trainer, of a fresh module (stage 1).
    fresh = lit_module_class()()
    evaluator = quiet_trainer(world, _strategy(1))
    evaluator.validate(fresh, loader(n_batches=1, world=world), ckpt_path=path, verbose=False)
    with torch.no_grad(), evaluator.strategy.engine.gathered_parameters():
        validated = fresh.model.eval()(_probe())
    listed = sorted(os.listdir(os.path.dirname(path)))
    return logits, validated, os.path.isfile(path), listed


def test_a_full_checkpoint_is_one_file_that_lightning_torch_and_a_plain_optimizer_open(tmp_path):
    path = str(tmp_path / "last.ckpt")
    (logits, validated, is_file, listed), _ = run_world(_fit_and_save, 2, path)
    assert is_file and listed == ["last.ckpt"]  # the sharded copy it came from is gone
    assert torch.equal(validated, logits)

    checkpoint = torch.load(path, weights_only=True)  # nothing but tensors and containers
    assert checkpoint["global_step"] == 5 and "loops" in checkpoint

    # Lightning's loader, in one plain process: the same model.
    model = lit_module_class().load_from_checkpoint(path)
    with torch.no_grad():
        assert torch.equal(model.model(_probe()), logits)

    # A plain optimizer takes the state as it takes FSDP's full one (names by position).
    optimizer = make_optimizer(model.model)
    state = checkpoint["optimizer_states"][0]
    names = [n for g in state["param_groups"] for n in g["params"]]
    assert names == [
        f"model.{n}" for g in optimizer.param_groups for p in g["params"]
        for n, q in model.model.named_parameters() if q is p
    ]  # fmt: skip
    optimizer.load_state_dict(state)
    some = optimizer.param_groups[0]["params"][0]
    assert torch.equal(optimizer.state[some]["exp_avg"], state["state"][names[0]]["exp_avg"])
    assert int(optimizer.state[some]["step"]) == 5


@pytest.mark.parametrize("resume_stage", ["zero1", "zero3", "ddp"])
def test_a_full_checkpoint_resumes_at_another_stage_as_the_uninterrupted_run(
    tmp_path, resume_stage
):
    """Written whole at stage 3 after one epoch of 5 steps; resumed with ckpt_path at
    `resume_stage` (Lightning's own DDP too: its optimizer loads the state by position),
    the second epoch's losses, scheduler and step count are the uninterrupted run's (the
    optimizer state came back, resharded)."""
    ckpt = str(tmp_path / "epoch1.ckpt")
    kw = dict(epoch_steps=5, accumulate=1)
    full = run_world(fit, 2, "zero3", -1, None, None, True, max_epochs=2, **kw)
    run_world(fit, 2, _strategy(3), -1, None, None, True, save_at_end=ckpt, max_epochs=1, **kw)
    assert os.path.isfile(ckpt)
    resumed = run_world(fit, 2, resume_stage, -1, None, ckpt, True, max_epochs=2, **kw)
    for a, b in zip(resumed, full):
        assert a["losses"] == pytest.approx(b["losses"][5:], rel=1e-5)
        assert a["lr"] == b["lr"] and a["global_step"] == b["global_step"] == 10


@pytest.mark.parametrize("resume_stage", ["zero1", "zero3"])
def test_a_ddp_checkpoint_resumes_at_a_zero_stage_as_the_uninterrupted_ddp_run(
    tmp_path, resume_stage
):
    """Lightning's DDP writes its optimizer state keyed by position (torch's
    `optimizer.state_dict()`); resumed at a ZeRO stage, each group's positions are matched
    in order to the engine's parameters, as torch's `load_state_dict` does, and the second
    epoch is the uninterrupted DDP run's."""
    ckpt = str(tmp_path / "ddp_epoch1.ckpt")
    kw = dict(epoch_steps=5, accumulate=1)
    full = run_world(fit, 2, "ddp", -1, None, None, True, max_epochs=2, **kw)
    run_world(fit, 2, "ddp", -1, None, None, True, save_at_end=ckpt, max_epochs=1, **kw)
    state = torch.load(ckpt, weights_only=True)
    assert isinstance(state["optimizer_states"][0]["param_groups"][0]["params"][0], int)
    resumed = run_world(fit, 2, resume_stage, -1, None, ckpt, True, max_epochs=2, **kw)
    for a, b in zip(resumed, full):
        assert a["losses"] == pytest.approx(b["losses"][5:], rel=1e-5)
        assert a["lr"] == b["lr"] and a["global_step"] == b["global_step"] == 10


def test_an_unknown_state_dict_type_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'sharded'.*'full'"):
        _strategy(3, "fsdp")


def _fabric_strategy(stage: int, state_dict_type: str = "full"):
    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    return ZeroFabricStrategy(stage=stage, state_dict_type=state_dict_type)


def test_fabric_saves_one_file_that_a_plain_process_and_another_stage_load(tmp_path):
    """`fabric.save(path, {"model", "optimizer", "step"})` at stage 3 with
    state_dict_type="full": one file with each entry under the name it was saved by, as
    Fabric's FSDP writes it. A plain model and AdamW load it strictly and give the
    resumed run's first loss; `fabric.load` at stage 1 resumes as the uninterrupted run."""
    from test_fabric import _loop

    ckpt = str(tmp_path / "half.pt")
    full = run_world(_loop, 2, _fabric_strategy(3), 10, ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 5 and {"model", "optimizer"} <= set(saved)

    model = make_model()
    model.load_state_dict(saved["model"])  # strict: every name, nothing more
    make_optimizer(model).load_state_dict(saved["optimizer"])

    resumed = run_world(_loop, 2, "zero1", 10, None, ckpt)
    for a, b in zip(resumed, full):
        assert a == pytest.approx(b[10:], rel=1e-5)
    x, y = local_batch(5, 0, 0, 2)
    with torch.no_grad():
        assert (model(x, y) / 2).item() == pytest.approx(resumed[0][0], rel=1e-6)


def test_accelerate_save_state_full_writes_one_file_that_another_stage_resumes_from(tmp_path):
    """`ZeroPlugin(state_dict_type="full")`: save_state writes the model and optimizer
    state as one file (`zero_model.pt`) instead of the sharded directory; load_state at
    stage 1 continues as the uninterrupted stage-3 run."""
    pytest.importorskip("accelerate")
    from test_accelerate import ACCUM, STEPS, _loop

    ckpt = str(tmp_path / "state")
    full = run_world(_loop, 2, "zero", 3, range(STEPS), ckpt, state_dict_type="full")
    files = os.listdir(ckpt)
    assert "zero_model.pt" in files and "zero_model" not in files
    whole = torch.load(os.path.join(ckpt, "zero_model.pt"), weights_only=True)
    model = make_model()
    model.load_state_dict(whole["model"])
    make_optimizer(model).load_state_dict(whole["optimizer"])
    resumed = run_world(_loop, 2, "zero", 1, range(3, STEPS), None, ckpt)
    for a, b in zip(resumed, full):
        assert a["losses"] == pytest.approx(b["losses"][3 * ACCUM :], rel=1e-5)
        assert a["lr"] == b["lr"]


def _save_on_a_full_disk(rank, world, path):
    from zero_strategy.checkpoint import one_file_writer
    from zero_strategy.checkpoint.safe_load import CheckpointError

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29542")
    trainer = quiet_trainer(world, _strategy(3), max_steps=1, num_sanity_val_steps=0)
    trainer.fit(lit_module_class()(), loader(n_batches=1, world=world))
    one_file_writer.free_bytes = lambda path: 1024  # 1 KiB left for the file
    try:
        trainer.save_checkpoint(path)
    except CheckpointError as e:
        return str(e), sorted(os.listdir(os.path.dirname(path)))
    return None, []


def test_a_disk_without_room_for_the_file_is_refused_on_every_rank_naming_sharded(tmp_path):
    """With no room for the file, every rank raises before it is begun, naming the
    sharded form, and nothing is left behind."""
    for message, listed in run_world(_save_on_a_full_disk, 2, str(tmp_path / "last.ckpt")):
        assert message is not None and "state_dict_type='sharded'" in message, message
        assert "MiB free" in message and listed == []


def _bf16_resumes(rank, world, folder):
    import torch.distributed as dist

    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.checkpoint.consolidate import consolidate

    def engine_at(seed):
        model = make_model(seed).to(torch.bfloat16)  # a bf16 model, the masters fp32
        config = ZeroConfig(stage=3, compute_dtype="bf16")
        return ZeroEngine(model, make_optimizer(model), config)

    def steps(engine, first):
        losses = []
        for step in range(first, first + 2):
            loss = engine(*local_batch(step, 0, rank, world))
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        return losses

    engine = engine_at(0)
    steps(engine, 0)
    engine.save_checkpoint(f"{folder}/sharded")
    engine.close()
    if rank == 0:
        consolidate(f"{folder}/sharded", f"{folder}/one.ckpt", "lightning", with_optimizer=True)
    dist.barrier()
    out = []
    for path in (f"{folder}/sharded", f"{folder}/one.ckpt"):
        engine = engine_at(1)  # other weights: all of it must come from the checkpoint
        engine.load_checkpoint(path)
        out.append(steps(engine, 2))
        engine.close()
    return out


def test_a_bf16_models_one_file_holds_its_fp32_masters_and_resumes_as_the_sharded_one(tmp_path):
    """In bf16 with fp32 masters, the one file keeps the weights in the masters'
    precision (a bf16 copy would round them), so a resume from it continues exactly as
    one from the sharded checkpoint."""
    for from_sharded, from_file in run_world(_bf16_resumes, 2, str(tmp_path)):
        assert from_file == from_sharded
    weights = torch.load(tmp_path / "one.ckpt", weights_only=True)["state_dict"]
    assert {t.dtype for t in weights.values()} == {torch.float32}


def _save_load_plain_and_set_up(rank, world, folder, state_dict_type):
    """Lightning's test_ddp_save_load with state_dict_type="full": a module saved before
    and after fabric.setup, each file loaded into a plain module (never set up) and into
    a second set-up one (replicated: the engine shards the first), which is then saved;
    the client entry restored each time."""
    import lightning as L

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    strategy = _fabric_strategy(3, state_dict_type)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model(seed=3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(f"{folder}/before_setup.ckpt", {"model": model, "tag": 7})
    set_up = fabric.setup(model)
    fabric.save(f"{folder}/after_setup.ckpt", {"model": set_up, "tag": 8})
    out = []
    for name, tag in (("before_setup", 7), ("after_setup", 8)):
        plain = make_model(seed=4)
        state = {"model": plain, "tag": 0}
        fabric.load(f"{folder}/{name}.ckpt", state)
        is_file = os.path.isfile(f"{folder}/{name}.ckpt")
        out.append((is_file == (state_dict_type == "full"), state["tag"] == tag))
        assert all(torch.equal(plain.state_dict()[k], v) for k, v in want.items()), name
    other = fabric.setup(make_model(seed=4))  # replicated: the engine shards `set_up`
    fabric.load(f"{folder}/before_setup.ckpt", {"model": other})
    loaded = other.state_dict()  # (at stage 3 gathered for the call, on every rank)
    out.append([k for k, v in want.items() if not torch.equal(loaded[k], v)])
    fabric.save(f"{folder}/other.ckpt", {"model": other})  # its own weights, not set_up's
    return out


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_fabric_saves_and_loads_modules_the_engine_does_not_shard(tmp_path, state_dict_type):
    """A module never set up, and one set up without an optimizer while the engine shards
    another, are saved and loaded whole (they are whole on every rank, as under DDP); the
    second was loaded into and saved from the engine's module instead, silently."""
    folder = str(tmp_path)
    for before, after, set_up in run_world(_save_load_plain_and_set_up, 2, folder, state_dict_type):
        assert before == (True, True) and after == (True, True) and set_up == [], set_up
    if state_dict_type == "full":
        saved = torch.load(tmp_path / "other.ckpt", weights_only=True)["model"]
    else:
        from zero_strategy.checkpoint.consolidate import iter_tensors

        saved = dict(iter_tensors(tmp_path / "other.ckpt"))
    assert all(torch.equal(saved[k], v) for k, v in make_model(seed=3).state_dict().items())
