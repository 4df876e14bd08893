"""The optimizer's side in host memory apart from the training device (offload_optimizer
"cpu" or "disk" on an accelerator): fp32 masters and gradient shards of their own, the
reduced gradients brought to them, the step on the host, the compute copies sent back.

This machine has no accelerator, so the tests stand one in: the engine is told that the
optimizer's side lives on `cpu:0`, which torch compares unequal to the training device
`cpu` while the memory is the same. Every tensor the split creates, and every copy
between the two sides, then happens as on a GPU (the copies cost nothing here, and
page-locked memory is not used); what no CPU run can show is a tensor left on the wrong
side of a real device boundary, which the GPU check covers."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from training import local_batch, make_model, make_optimizer, train_zero, train_zero_resumable
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.builder import steps as builder_steps
from zero_strategy.memory.accounting import held_bytes

STEPS, ACCUM, CLIP = 6, 2, 0.5
HOST = torch.device("cpu", 0)  # != torch.device("cpu"), the same memory


def _host_apart(config, device):
    """The engine's rule, with the optimizer's side on the stand-in host."""
    return HOST, False


def _apart(function):
    """`function` run with the optimizer's side apart from the training device."""

    def run(*args, **kwargs):
        builder_steps.optimizer_host = _host_apart
        return function(*args, **kwargs)

    run.__name__ = function.__name__
    return run


def train_apart(*args, **kwargs):
    return _apart(train_zero)(*args, **kwargs)


def train_resumable_apart(*args, **kwargs):
    return _apart(train_zero_resumable)(*args, **kwargs)


@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        (1, {}),
        (2, {}),
        (3, {}),
        (2, {"compute_dtype": "fp16"}),
        (3, {"compute_dtype": "bf16"}),
    ],
    ids=["stage1", "stage2", "stage3", "stage2-fp16", "stage3-bf16"],
)
def test_the_optimizer_apart_trains_bit_identically(stage, extra, tmp_path):
    """10 steps with accumulation and clipping: the masters and gradient shards on the
    host side, the step there, the compute copies sent back; bit for bit the same losses
    and weights as the optimizer on the training device."""
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage, **extra)
    apart = run_world(train_apart, 2, STEPS, ACCUM, CLIP, stage, offload_optimizer="cpu", **extra)
    (mem_losses, mem_state), (losses, state) = memory[0], apart[0]
    assert losses == mem_losses
    assert all(torch.equal(state[k], mem_state[k]) for k in mem_state)


def test_the_optimizer_apart_with_its_side_on_disk_trains_bit_identically(tmp_path):
    """offload_optimizer="disk" apart from the device, in fp32: the masters (tensors of
    their own now, as on a GPU) go to their own file with the state and the gradients."""
    disk = {
        "offload_optimizer": "disk",
        "offload_dir": str(tmp_path),
        "offload_tile_size": 700,
        "offload_buffer_count": 2,
    }
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, 2)
    apart = run_world(train_apart, 2, STEPS, ACCUM, CLIP, 2, **disk)
    assert apart[0][0] == memory[0][0]
    assert all(torch.equal(apart[0][1][k], memory[0][1][k]) for k in memory[0][1])


def _sides(rank, world, stage):
    """After two steps: the tensors of each side, and the memory figures."""
    builder_steps.optimizer_host = _host_apart
    model = make_model()
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=stage, offload_optimizer="cpu")
    )
    for step in range(2):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    units = [u for u in engine.units if u.layout.numel]
    apart = all(
        u.master.untyped_storage().data_ptr()
        != (u.shard if stage == 3 else u.full).untyped_storage().data_ptr()
        and u.grad_opt.untyped_storage().data_ptr()
        != (u.grad_full.untyped_storage().data_ptr() if u.grad_full is not None else 0)
        for u in units
        if u.layout.trainable
    )
    masters = sum(u.master.nbytes for u in units)
    report = engine.memory_report()
    # The same tensors counted as an accelerator's engine would: what is on the CPU is
    # host memory there.
    as_on_gpu = held_bytes(
        engine.units,
        engine.optim.optimizer_set,
        engine.module,
        engine.stage,
        device=torch.device("cuda"),
    )
    engine.close()
    return apart, masters, report, as_on_gpu


@pytest.mark.parametrize("stage", [1, 3])
def test_the_sides_hold_tensors_of_their_own_and_are_reported(stage):
    """In fp32 too, the masters and the optimizer's gradient slices are tensors of their
    own (on a GPU they live in host memory); the report counts the masters exactly, and
    an accelerator's engine would report the CPU side under host_<kind>."""
    for apart, masters, report, as_on_gpu in run_world(_sides, 2, stage):
        assert apart
        assert report["master_params"] == masters
        assert "host_total" not in report  # one memory: no host figures on the CPU
        assert as_on_gpu["total"] == 0
        for kind in ("parameters", "master_params", "gradients", "optimizer_state"):
            assert as_on_gpu[f"host_{kind}"] == report[kind] > 0


def test_a_checkpoint_of_the_optimizer_apart_resumes_without_it(tmp_path):
    """Saved at world 2 with the optimizer's side apart, resumed at world 1 on the device:
    bit for bit the continuation of the run that never offloaded."""
    plain_ckpt, apart_ckpt = str(tmp_path / "plain"), str(tmp_path / "apart")
    run_world(train_zero_resumable, 2, 2, range(3), plain_ckpt, False, True)
    run_world(
        train_resumable_apart, 2, 2, range(3), apart_ckpt, False, True, offload_optimizer="cpu"
    )
    plain = run_world(train_zero_resumable, 1, 2, range(3, 6), plain_ckpt, True, False)[0]
    moved = run_world(train_zero_resumable, 1, 2, range(3, 6), apart_ckpt, True, False)[0]
    assert moved[0] == plain[0]
    assert all(torch.equal(moved[1][k], plain[1][k]) for k in plain[1])


def test_where_the_optimizer_and_the_parameters_live_on_an_accelerator(tmp_path):
    """On a CUDA device the optimizer's side goes to host memory with either offload,
    page-locked unless a disk tier resizes it; stage 3's parameter shards go there with
    offload_params, and one process keeps stage 3 then. On the CPU all stays where it is
    (one memory), and only the disk keeps stage 3."""
    from zero_strategy.offload import keeps_stage_3, optimizer_host, parameters_host

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    disk = {"offload_dir": str(tmp_path)}

    def config(optimizer="none", params="none"):
        extra = disk if "disk" in (optimizer, params) else {}
        return ZeroConfig(stage=3, offload_optimizer=optimizer, offload_params=params, **extra)

    assert optimizer_host(config("cpu"), cuda) == (cpu, True)
    assert optimizer_host(config("disk"), cuda) == (cpu, False)
    assert optimizer_host(config(params="cpu"), cuda) == (cpu, True)
    assert optimizer_host(config("cpu", "disk"), cuda) == (cpu, False)
    assert optimizer_host(config(), cuda) == (cuda, False)
    assert optimizer_host(config("cpu", "cpu"), cpu) == (cpu, False)
    assert parameters_host(config(params="cpu"), cuda, cpu) == cpu
    assert parameters_host(config("cpu"), cuda, cpu) == cuda
    assert parameters_host(config(params="cpu"), cpu, cpu) == cpu
    assert keeps_stage_3(config(params="cpu"), cuda) and keeps_stage_3(config(params="disk"), cpu)
    assert not keeps_stage_3(config(params="cpu"), cpu)


def _params_apart(config, device, host):
    return HOST if config.offload_params != "none" else device


def _train_params_apart(*args, **kwargs):
    builder_steps.parameters_host = _params_apart
    builder_steps.keeps_stage_3 = lambda config, device: config.offload_params != "none"
    return train_apart(*args, **kwargs)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_parameters_on_the_host_train_bit_identically(dtype, world):
    """offload_params="cpu" from an accelerator: stage 3's shards (and the optimizer's
    side) on the host, each copied to the device for its gather; one process keeps stage
    3. The same losses and weights, bit for bit, as stage 3 with nothing offloaded (at
    world 1: with the parameters on disk, the other way to keep stage 3 there)."""
    config = {"compute_dtype": dtype}
    apart = run_world(
        _train_params_apart, world, STEPS, ACCUM, CLIP, 3, offload_params="cpu", **config
    )[0]
    if world == 1:  # plain training at world 1 runs unsharded: another rounding order
        return _same_as_disk_at_world_1(apart, config)
    memory = run_world(train_zero, world, STEPS, ACCUM, CLIP, 3, **config)[0]
    assert apart[0] == memory[0]
    assert all(torch.equal(apart[1][k], memory[1][k]) for k in memory[1])


def _same_as_disk_at_world_1(apart, config):
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        disk = {"offload_params": "disk", "offload_dir": directory}
        on_disk = run_world(train_zero, 1, STEPS, ACCUM, CLIP, 3, **disk, **config)[0]
    assert apart[0] == on_disk[0]
    assert all(torch.equal(apart[1][k], on_disk[1][k]) for k in on_disk[1])


def _report_apart(rank, world, stage, cfg):
    builder_steps.optimizer_host = _host_apart
    model = make_model(cfg=cfg)
    config = ZeroConfig(stage=stage, offload_optimizer="cpu")
    engine = ZeroEngine(model, make_optimizer(model), config)
    x, y = local_batch(0, 0, rank, world, cfg)
    engine.backward(engine(x, y))
    engine.step()
    report = engine.memory_report()
    engine.close()
    return report


@pytest.mark.parametrize("stage", [1, 3])
def test_the_planner_predicts_the_sides_within_2_percent(stage):
    """`estimate --offload cpu`: the masters, the fp32 gradient shards and the state in
    host memory, the compute copies (and at stages 0-1 the gradient buffers) on the
    device; each kind within 2% of what the engine holds with its sides apart."""
    from test_planner import WIDER

    from zero_strategy.memory.planner import count_params, plan

    params, root = count_params(make_model(cfg=WIDER))
    predicted = plan(params, 2, stage, "fp32", root_params=root, offload="cpu")
    report = run_world(_report_apart, 2, stage, WIDER)[0]
    host, device = predicted.host_memory, predicted.memory
    expected = {
        "parameters": device["parameters"],
        "master_params": host["master_params"],
        "gradients": device["gradients"] + host["gradients"],
        "optimizer_state": host["optimizer_state"],
    }
    for kind, value in expected.items():
        assert abs(value - report[kind]) <= 0.02 * report[kind], (kind, predicted, report)
    assert (device["gradients"] > 0) == (stage < 2)


def test_an_optimizer_tied_to_the_device_is_refused_when_offloaded(monkeypatch):
    """With the optimizer on the host, `capturable=True` (CUDA graphs' optimizer, whose
    state must be on the device) cannot step: refused at construction, naming the fix."""
    from zero_strategy.optim.shard_views import UnsupportedOptimizerError

    monkeypatch.setattr(builder_steps, "optimizer_host", _host_apart)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    with pytest.raises(UnsupportedOptimizerError, match=r"param group 0 has capturable=True"):
        ZeroEngine(model, optimizer, ZeroConfig(offload_optimizer="cpu"))


def _hf_apart(*args, **kwargs):
    from test_hf_models import _train

    builder_steps.optimizer_host = _host_apart
    builder_steps.parameters_host = _params_apart
    return _train(*args, **kwargs)


@pytest.mark.parametrize("arch", ["gpt2", "llama-tied"])
def test_hf_models_train_with_both_sides_on_the_host(arch):
    """Hugging Face GPT-2 and a Llama with tied embeddings at stage 3, the optimizer's
    side and the parameter shards on the (stand-in) host: DDP's losses and weights, to
    the bit."""
    from test_hf_models import _train

    ddp_losses, ddp_state = run_world(_train, 2, arch, "ddp")[0]
    losses, state = run_world(_hf_apart, 2, arch, 3, offload_optimizer="cpu", offload_params="cpu")[
        0
    ]
    assert losses == ddp_losses
    assert all(torch.equal(state[k], v) for k, v in ddp_state.items() if k in state)
