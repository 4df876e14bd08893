"""ZeroAccelerator: an Accelerate loop trains as under plain Accelerate (DDP), resumes with
save_state/load_state, consolidates with get_state_dict/save_model, and runs under
`accelerate launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import preload, run_world
from training import local_batch, make_model, make_optimizer, rel_l2

pytest.importorskip("accelerate")
preload("zero_strategy.integrations.accelerate")

ROOT = Path(__file__).resolve().parents[1]
STEPS, ACCUM = 6, 2
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _accelerator(kind: str, stage: int, accum: int = ACCUM, **kwargs):
    from accelerate import Accelerator

    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    # Accelerate raises a CPU process to 2 threads unless this is set; in a rank forked
    # from a parent whose OpenMP pool is already up, that can deadlock.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    state_dict_type = kwargs.pop("state_dict_type", "sharded")
    common = dict(cpu=True, gradient_accumulation_steps=accum, **kwargs)
    if kind == "ddp":
        return Accelerator(**common)
    plugin = ZeroPlugin(stage=stage, state_dict_type=state_dict_type)
    return ZeroAccelerator(zero_plugin=plugin, **common)


def _loop(
    rank, world, kind, stage=3, steps=range(STEPS), save=None, load=None, accum=ACCUM, **kwargs
):
    """The usual Accelerate loop: accumulate, clip when syncing, a per-step scheduler."""
    accelerator = _accelerator(kind, stage, accum, **kwargs)
    model = make_model(seed=0 if load is None else 1)  # a resume must not need the init
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if load:
        accelerator.load_state(load)
    losses = []
    for step in steps:
        for micro in range(accum):
            with accelerator.accumulate(model):
                x, y = local_batch(step, micro, rank, world)
                loss = model(x, y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        if save and step == steps[0] + 2:
            accelerator.save_state(save)
    state = accelerator.get_state_dict(model)
    engine = getattr(accelerator, "engine", None)
    return {
        "reduced": engine
        and sum(v["bytes"] for k, v in engine.comm_report().items() if k in REDUCTIONS),
        "losses": losses,
        "state": state,
        "type": accelerator.distributed_type.value,
        "lr": scheduler.get_last_lr()[0],
        "unwrapped_is_model": accelerator.unwrap_model(model) is model,
    }


@pytest.fixture(scope="module")
def ddp_run():
    return run_world(_loop, 2, "ddp")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_same_training_as_plain_accelerate(stage, ddp_run):
    for rank, (ours, ddp) in enumerate(zip(run_world(_loop, 2, "zero", stage), ddp_run)):
        assert ours["type"] == ddp["type"] == "MULTI_CPU"
        assert ours["unwrapped_is_model"]  # never wrapped: the user's module
        assert len(ours["losses"]) == STEPS * ACCUM
        for got, want in zip(ours["losses"], ddp["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want)
        assert ours["lr"] == ddp["lr"]  # the scheduler stepped once per optimizer step
        if rank == 0:
            assert ours["state"].keys() == ddp["state"].keys()
            # Adam turns reduction-order rounding of the clip coefficient into ~1e-7.
            assert rel_l2(ours["state"], ddp["state"]) < 1e-5
        else:
            assert ours["state"] == {}  # consolidated on the main process only


def test_accumulate_reduces_gradients_once_per_step():
    """accelerator.accumulate(model) runs the engine's no_sync: the micro-batches that do
    not step move no gradient bytes."""
    accumulated = run_world(_loop, 2, "zero", 2, accum=2)[0]["reduced"]
    single = run_world(_loop, 2, "zero", 2, accum=1)[0]["reduced"]
    assert accumulated == single > 0


def _grad_after_zero_grad(rank, world, kind, stage):
    accelerator = _accelerator(kind, stage, accum=1)
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    seen = []
    for set_to_none in (True, False):
        x, y = local_batch(0, 0, rank, world)
        accelerator.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        grads = [p.grad for p in model.parameters()]
        seen.append(all(g is None if set_to_none else not g.any() for g in grads))
    return seen


@pytest.mark.parametrize("stage", [0, 1])  # (stages 2-3 read None after either)
def test_zero_grad_leaves_none_or_zeros_as_under_plain_accelerate(stage):
    ddp = run_world(_grad_after_zero_grad, 2, "ddp", stage)
    assert run_world(_grad_after_zero_grad, 2, "zero", stage) == ddp == [[True, True]] * 2


def test_save_state_then_load_state_continues_exactly(tmp_path):
    ckpt = str(tmp_path / "state")
    full = run_world(_loop, 2, "zero", 3, range(STEPS), ckpt)
    resumed = run_world(_loop, 2, "zero", 3, range(3, STEPS), None, ckpt)
    for a, b in zip(resumed, full):
        assert a["losses"] == b["losses"][3 * ACCUM :]
        assert a["lr"] == b["lr"]
    files = sorted(os.listdir(ckpt))
    assert "zero_model" in files and not any(f.startswith("model") for f in files)
    index = json.loads(Path(ckpt, "zero_model", "index.json").read_text())
    assert index["world_size"] == 2 and index["stage"] == 3
    marker = torch.load(Path(ckpt, "optimizer.bin"), weights_only=True)
    assert "zero_strategy" in marker  # the optimizer state is in the sharded checkpoint


def _save_model(rank, world, out):
    from safetensors.torch import load_file

    accelerator = _accelerator("zero", 3)
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    x, y = local_batch(0, 0, rank, world)
    accelerator.backward(model(x, y))
    optimizer.step()
    optimizer.zero_grad()
    expected = accelerator.get_state_dict(model)
    accelerator.save_model(model, out, max_shard_size="20KB")
    accelerator.wait_for_everyone()
    index = json.loads(Path(out, "model.safetensors.index.json").read_text())
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(Path(out, name)))
    return expected, loaded


def test_save_model_writes_consolidated_safetensors_shards(tmp_path):
    out = str(tmp_path / "model")
    expected, loaded = run_world(_save_model, 2, out)[0]
    # Tied lm_head/wte is stored once, as the Hugging Face writers do.
    assert set(loaded) == set(expected) - {"lm_head.weight"}
    for name, value in loaded.items():
        assert torch.equal(value, expected[name]), name
    fresh = make_model(seed=5)
    fresh.load_state_dict(loaded, strict=False)
    assert torch.equal(fresh.lm_head.weight, expected["wte.weight"])


def _bf16(rank, world):
    return _loop(rank, world, "zero", 3, mixed_precision="bf16")


def test_bf16_autocast_stays_close_to_fp32(ddp_run):
    for ours, fp32 in zip(run_world(_bf16, 2), ddp_run):
        assert all(
            abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ours["losses"], fp32["losses"], strict=True)
        )


def _fp16_on_cpu(rank, world, kind):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _loop(rank, world, kind, 3, mixed_precision="fp16")
    result["said"] = [str(w.message) for w in caught if "mixed_precision='fp16'" in str(w.message)]
    return result


def test_fp16_on_the_cpu_trains_in_fp32_as_accelerate_does_under_ddp():
    """Accelerate runs mixed_precision="fp16" as fp32 on the CPU (no fp16 autocast or
    scaler there): fp32 weights, fp32 inputs. The engine used to compute in fp16 weights,
    and a Linear fed fp32 inputs failed ("mat1 and mat2 must have the same dtype")."""
    ddp = run_world(_fp16_on_cpu, 2, "ddp")
    ours = run_world(_fp16_on_cpu, 2, "zero")
    for got, want in zip(ours, ddp):
        assert want["said"] == [] and len(got["said"]) == 1
        assert "mixed_precision='bf16'" in got["said"][0] and "compute_dtype" in got["said"][0]
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
    assert all(v.dtype == torch.float32 for v in ours[0]["state"].values())


def test_plugin_reads_file_then_environment_then_arguments(tmp_path, monkeypatch):
    from zero_strategy.integrations.accelerate import ZeroPlugin

    config = tmp_path / "zero.yaml"
    config.write_text("stage: 1\nbucket_size: 1000\nprefetch_depth: 3\n")
    monkeypatch.setenv("ZERO_STRATEGY_CONFIG_FILE", str(config))
    resolved = ZeroPlugin().resolve("no")
    assert (resolved.stage, resolved.bucket_size, resolved.prefetch_depth) == (1, 1000, 3)
    monkeypatch.setenv("ZERO_STRATEGY_STAGE", "2")
    assert ZeroPlugin().resolve("no").stage == 2
    monkeypatch.setenv("ZERO_STRATEGY_EXPERT_PARALLEL_SIZE", "2")
    assert ZeroPlugin().resolve("no").expert_parallel_size == 2
    explicit = ZeroPlugin(stage=3, options={"bucket_size": 50}).resolve("fp16")
    assert (explicit.stage, explicit.bucket_size, explicit.compute_dtype) == (3, 50, "fp16")
    assert ZeroPlugin().resolve("bf16").compute_dtype == "fp32"  # under Accelerate's autocast


def test_plugin_errors_name_the_problem(tmp_path, monkeypatch):
    from zero_strategy import ZeroConfigError
    from zero_strategy.integrations.accelerate import ZeroPlugin

    monkeypatch.setenv("ZERO_STRATEGY_STAGE", "three")
    with pytest.raises(ValueError, match="ZERO_STRATEGY_STAGE='three' is not a stage"):
        ZeroPlugin().resolve("no")
    monkeypatch.delenv("ZERO_STRATEGY_STAGE")
    monkeypatch.setenv("ZERO_STRATEGY_EXPERT_PARALLEL_SIZE", "two")
    with pytest.raises(ValueError, match="EXPERT_PARALLEL_SIZE='two' is not a number of ranks"):
        ZeroPlugin().resolve("no")
    monkeypatch.delenv("ZERO_STRATEGY_EXPERT_PARALLEL_SIZE")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml"):
        ZeroPlugin(config_file=str(tmp_path / "missing.yaml")).resolve("no")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"stgae": 3}))
    with pytest.raises(ZeroConfigError, match=r"Unknown ZeroConfig option\(s\) \['stgae'\]"):
        ZeroPlugin(config_file=str(typo)).resolve("no")
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not supported"):
        ZeroPlugin().resolve("fp8")


def test_accelerate_launch_runs_the_example(tmp_path):
    """The real launcher: `accelerate launch --multi_gpu --num_processes 2` on CPU, the
    stage from the environment it copies into each process."""
    out = tmp_path / "run"
    env = {**os.environ, "ZERO_STRATEGY_STAGE": "3", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", "29541",
        str(ROOT / "examples" / "train_accelerate.py"), "--cpu", "--steps", "4",
        "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step   3  loss" in result.stdout
    index = json.loads((out / "state" / "zero_model" / "index.json").read_text())
    assert index["world_size"] == 2 and index["stage"] == 3
    assert (out / "model" / "model.safetensors").exists()


def _lifecycle(rank, world, tmp):
    """What Trainer trials and diffusers-style scripts do around the training loop."""
    accelerator = _accelerator("zero", 3)
    first = make_model()
    model, optimizer = accelerator.prepare(first, make_optimizer(first))
    x, y = local_batch(0, 0, rank, world)
    accelerator.backward(model(x, y))
    # Clipping by the optimizer's parameters (its shard views) is the global clip too.
    shard_params = [p for group in optimizer.param_groups for p in group["params"]]
    by_optimizer = accelerator.clip_grad_norm_(shard_params, 1e9)
    by_model = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    # A user hook that pops one weight per model, as diffusers' save hooks do.
    popped = []
    accelerator.register_save_state_pre_hook(
        lambda models, weights, out: popped.extend(weights.pop() for _ in list(models))
    )
    accelerator.save_state(tmp)
    # A second training with a new model after free_memory(), as a Trainer trial does.
    accelerator.free_memory()
    second = make_model(seed=3)
    model2, optimizer2 = accelerator.prepare(second, make_optimizer(second))
    accelerator.backward(model2(x, y))
    optimizer2.step()
    return float(by_optimizer), float(by_model), len(popped), accelerator.engine.module is second


def test_clip_free_memory_and_user_save_hooks(tmp_path):
    for by_optimizer, by_model, popped, second in run_world(_lifecycle, 2, str(tmp_path / "s")):
        assert by_optimizer == by_model > 0
        assert popped == 1 and second


def _unwrapped_mid_training(rank, world, kind):
    """A parity check reads unwrap_model(model) between steps; training then goes on."""
    accelerator = _accelerator(kind, 3, accum=1)
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    losses, snapshots = [], []
    for step in range(4):
        x, y = local_batch(step, 0, rank, world)
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step in (1, 2):
            unwrapped = accelerator.unwrap_model(model)
            snapshots.append({n: p.detach().clone() for n, p in unwrapped.named_parameters()})
    return losses, snapshots


def test_unwrap_model_shows_the_full_parameters_and_training_goes_on():
    ddp = run_world(_unwrapped_mid_training, 2, "ddp")
    ours = run_world(_unwrapped_mid_training, 2, "zero")
    for (losses, snaps), (ddp_losses, ddp_snaps) in zip(ours, ddp):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ddp_losses))
        for snap, ddp_snap in zip(snaps, ddp_snaps):  # after step 2 and after step 3
            for name, value in ddp_snap.items():
                torch.testing.assert_close(snap[name], value, rtol=1e-5, atol=1e-6)


def _prepared_alone(rank, world, kind):
    """Accelerate's own no_sync checks (test_sync.py): a model prepared without an
    optimizer, run under no_sync, then synchronised by a plain backward and by
    trigger_sync_in_backward after several no_sync forwards. Its .grad after each backward,
    and whether ranks start from rank 0's weights, as under DDP."""
    accelerator = _accelerator(kind, 3, accum=1)
    model = make_model(seed=rank)  # different on each rank: DDP starts from rank 0's
    model = accelerator.prepare(model)
    inner = accelerator.unwrap_model(model)
    seen = []

    def grads():
        seen.append({n: p.grad.clone() for n, p in inner.named_parameters()})

    for micro in range(3):
        x, y = local_batch(0, micro, rank, world)
        if micro % 2 == 0:
            with accelerator.no_sync(model):
                accelerator.backward(model(x, y))
        else:
            accelerator.backward(model(x, y))
        grads()
    losses = []
    with accelerator.no_sync(model):
        for micro in range(3, 5):
            losses.append(model(*local_batch(0, micro, rank, world)))
    accelerator.backward(losses[0])  # the forward ran under no_sync: DDP keeps it local
    with accelerator.trigger_sync_in_backward(model):
        accelerator.backward(losses[1])
    grads()
    accelerator.end_training()
    return seen


def test_a_model_prepared_without_optimizer_is_averaged_as_ddp_does():
    ddp = run_world(_prepared_alone, 2, "ddp")
    ours = run_world(_prepared_alone, 2, "zero")
    name = "blocks.0.fc.weight"
    assert not torch.equal(ddp[0][0][name], ddp[1][0][name])  # no_sync: local
    assert torch.equal(ddp[0][1][name], ddp[1][1][name])  # synchronised
    for got_rank, want_rank in zip(ours, ddp):
        for got, want in zip(got_rank, want_rank):
            assert got.keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7)


def _optimizer_first(rank, world, kind):
    """The optimizer prepared before its model, in separate calls (Accelerate allows any
    order): here unsharded, with a warning, and its model replicated; the training is
    DDP's. A second optimizer over a model the engine shards is refused."""
    import pickle
    import warnings

    accelerator = _accelerator(kind, 3, accum=1)
    model = make_model(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = accelerator.prepare(make_optimizer(model))
    said = [str(w.message) for w in caught if "ZeroAccelerator" in str(w.message)]
    pickle.loads(pickle.dumps(optimizer))  # Accelerate's test_accelerated_optimizer_pickling
    model = accelerator.prepare(model)
    losses = []
    for step in range(3):
        loss = model(*local_batch(step, 0, rank, world))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    refused = []
    if kind == "zero":

        def refusal(*args) -> str:
            try:
                accelerator.prepare(*args)
            except ValueError as error:
                return str(error)
            return "accepted"

        # a second optimizer over the model the first one (unsharded) holds
        refused.append(refusal(make_optimizer(accelerator.unwrap_model(model))))
        first = make_model(seed=0)
        sharded, _ = accelerator.prepare(first, make_optimizer(first))
        refused.append(refusal(make_optimizer(sharded)))  # a second one over a sharded model
    accelerator.end_training()
    return losses, said, refused


def test_an_optimizer_prepared_before_its_model_trains_as_ddp_with_a_warning():
    ddp = run_world(_optimizer_first, 2, "ddp")
    ours = run_world(_optimizer_first, 2, "zero")
    for (losses, said, refused), (want, _, _) in zip(ours, ddp):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0)
        assert len(said) == 1 and "same prepare() call" in said[0]
        earlier, second = refused
        assert "prepared earlier" in earlier and "same prepare() call" in earlier
        assert "second optimizer" in second and "every optimizer over it at once" in second


def _two_optimizers(rank, world, kind, stage=3, shared=False, steps=range(4), save=None, load=None):
    """One model, two optimizers prepared with it (a GAN's generator and discriminator
    in one module, or SGD and Adam over the same weights), each stepped and cleared on
    its own after its own backward."""
    accelerator = _accelerator(kind, stage, accum=1)
    model = make_model(seed=0 if load is None else 1)
    params = list(model.parameters())
    third = len(params) // 3
    adam = torch.optim.Adam(params[: 2 * third] if shared else params[:third], lr=3e-3)
    sgd = torch.optim.SGD(params[third:], lr=0.05, momentum=0.9)
    model, adam, sgd = accelerator.prepare(model, adam, sgd)
    if load:
        accelerator.load_state(load)
    losses = []
    for step in steps:
        if save and step == steps[0] + 2:
            accelerator.save_state(save)
        for micro, optimizer in enumerate((adam, sgd)):
            x, y = local_batch(step, micro, rank, world)
            loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        adam.zero_grad()  # the second backward's gradients of Adam's own parameters
    return {"state": accelerator.get_state_dict(model), "losses": losses}


@pytest.fixture(scope="module")
def ddp_two_optimizers():
    return {shared: run_world(_two_optimizers, 2, "ddp", shared=shared)[0] for shared in (0, 1)}


@pytest.mark.parametrize("shared", [False, True], ids=["disjoint", "shared"])
@pytest.mark.parametrize("stage", [1, 3])
def test_two_optimizers_of_one_model_train_as_plain_accelerate(stage, shared, ddp_two_optimizers):
    ddp = ddp_two_optimizers[int(shared)]
    ours = run_world(_two_optimizers, 2, "zero", stage, shared=shared)[0]
    for got, want in zip(ours["losses"], ddp["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert rel_l2(ours["state"], ddp["state"]) < 1e-5
    assert rel_l2(ours["state"], make_model().state_dict()) > 1e-3  # both stepped


def test_two_optimizers_of_one_model_resume_with_both_states(tmp_path):
    """save_state after 2 steps, load_state into a fresh run at another stage: the last
    2 steps equal the uninterrupted run's (SGD's momentum and Adam's moments of the
    shared weights both restored)."""
    ckpt = str(tmp_path / "state")
    through = run_world(_two_optimizers, 2, "zero", 3, True, range(4), ckpt)[0]
    resumed = run_world(_two_optimizers, 2, "zero", 1, True, range(2, 4), None, ckpt)[0]
    assert rel_l2(resumed["state"], through["state"]) < 1e-5
    for got, want in zip(resumed["losses"], through["losses"][4:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
