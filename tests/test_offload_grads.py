"""The gradients' fp32 shards on disk (stages 2-3 with offload_optimizer="disk"): training
identical to keeping them in memory, whether accumulation reduces every micro-batch (each
shard read back at each landing) or waits under no_sync(), with fp16 loss scaling and with
the parameters on disk too; what a user does between backward and step (full gradients,
clipping by value and by norm) sees the same values; and the memory figures, exactly."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from training import local_batch, make_model, make_optimizer, train_zero
from zero_strategy import ZeroConfig, ZeroEngine

STEPS, ACCUM, CLIP = 10, 2, 0.5
# Small tiles and the fewest buffers: many tiles per step, each buffer reused while the
# previous write may still be in flight.
SMALL = {"offload_tile_size": 700, "offload_buffer_count": 2}


@pytest.mark.parametrize(
    ("stage", "extra", "params"),
    [
        (2, {}, {}),
        (3, {}, {}),
        (2, {"compute_dtype": "fp16"}, {}),
        (3, {"compute_dtype": "bf16"}, {"offload_params": "disk"}),
    ],
    ids=["stage2", "stage3", "stage2-fp16", "stage3-bf16-params"],
)
def test_gradients_on_disk_train_bit_identically_when_every_micro_batch_reduces(
    stage, extra, params, tmp_path
):
    """10 steps of 2 micro-batches, each reduced (no no_sync): the second landing of each
    shard reads the first back. Clipping at 0.5, two param groups. Same losses and
    weights, bit for bit, as the gradients (and state) in memory."""
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage, use_no_sync=False, **extra)
    disk = run_world(
        train_zero,
        2,
        STEPS,
        ACCUM,
        CLIP,
        stage,
        use_no_sync=False,
        offload_optimizer="disk",
        offload_dir=str(tmp_path),
        **SMALL,
        **extra,
        **params,
    )
    (mem_losses, mem_state), (disk_losses, disk_state) = memory[0], disk[0]
    assert disk_losses == mem_losses
    assert all(torch.equal(disk_state[k], mem_state[k]) for k in mem_state)


def _between_backward_and_step(rank, world, stage, directory):
    """Three steps, looking at the gradients between backward and step each time."""
    model = make_model()
    extra = {"offload_optimizer": "disk", "offload_dir": directory, **SMALL} if directory else {}
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **extra))
    seen = []
    for step in range(3):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        report = engine.memory_report()
        grads = engine.full_grads()
        engine.clip_grad_value_(0.02)
        clipped = engine.full_grads()
        norm = engine.clip_grad_norm_(0.3)
        seen.append((grads, clipped, norm, report))
        engine.step()
        engine.zero_grad()
    shards = [
        u.grad_opt.numel() * u.grad_opt.element_size()
        for u in engine.units
        if u.grad_opt is not None and u.grad_opt.numel()
    ]
    weights = engine.full_state_dict()
    engine.close()
    return seen, weights, shards


@pytest.mark.parametrize("stage", [2, 3])
def test_between_backward_and_step_the_gradients_are_the_same_and_out_of_memory(stage, tmp_path):
    """full_grads(), clip_grad_value_ then clip_grad_norm_ (its returned norm): the same
    values with the gradient shards on disk. Meanwhile no gradient byte is in memory;
    the file holds each unit's shard rounded up to 4 KiB; and at most two units' shards
    were in memory at once during backward (the root unit, whose head and embedding
    gradients come first and last, and the block landing), never all of them."""
    memory = run_world(_between_backward_and_step, 2, stage, None)
    disk = run_world(_between_backward_and_step, 2, stage, str(tmp_path))
    for (mem_seen, mem_weights, shards), (disk_seen, disk_weights, _) in zip(memory, disk):
        for (grads, clipped, norm, mem_report), (d_grads, d_clipped, d_norm, report) in zip(
            mem_seen, disk_seen
        ):
            assert all(torch.equal(grads[k], d_grads[k]) for k in grads)
            assert all(torch.equal(clipped[k], d_clipped[k]) for k in clipped)
            assert torch.equal(norm, d_norm)
            assert mem_report["gradients"] == sum(shards)
            assert report["gradients"] == 0
            assert report["disk_gradients"] == sum(-(-n // 4096) * 4096 for n in shards)
            assert report["disk_total"] == report["disk_gradients"] + report["disk_optimizer_state"]
            assert 0 < report["peak_gradients"] <= sum(sorted(shards)[-2:])
            if len(shards) > 2:
                assert report["peak_gradients"] < sum(shards)
        if mem_weights is not None:
            assert all(torch.equal(mem_weights[k], disk_weights[k]) for k in mem_weights)


def _hooked(rank, world, directory):
    """A step pre-hook that reads and halves every gradient of the optimizer."""
    model = make_model()
    optimizer = make_optimizer(model)
    sums = []

    def halve(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        sums.append(float(sum(g.abs().sum() for g in grads)))
        for g in grads:
            g.mul_(0.5)

    optimizer.register_step_pre_hook(halve)
    extra = {"offload_optimizer": "disk", "offload_dir": directory, **SMALL} if directory else {}
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, **extra))
    for step in range(2):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        shown = sum(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        engine.step()
        engine.zero_grad()
    weights = engine.full_state_dict()
    engine.close()
    return sums, shown, weights


def test_a_step_hook_sees_and_changes_every_offloaded_gradient(tmp_path):
    """Outside the step an offloaded shard's gradient is not shown (its memory is not
    there); the user's step pre-hook sees every one, and its changes count."""
    memory = run_world(_hooked, 2, None)
    disk = run_world(_hooked, 2, str(tmp_path))
    for (mem_sums, mem_shown, mem_weights), (sums, shown, weights) in zip(memory, disk):
        # The same gradients; their sum over a different set of views (cut at tile
        # size on disk) rounds differently.
        assert sums == pytest.approx(mem_sums, rel=1e-6) and sums[0] > 0
        assert mem_shown > 0 and shown == 0
        if mem_weights is not None:
            assert all(torch.equal(mem_weights[k], weights[k]) for k in mem_weights)


def _staging_after_steps(rank, world, directory):
    model = make_model()
    config = ZeroConfig(
        stage=3,
        offload_optimizer="disk",
        offload_params="disk",
        offload_dir=directory,
        offload_buffer_count=3,
    )
    engine = ZeroEngine(model, make_optimizer(model), config)
    for step in range(3):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    staging = engine.staging
    held = (
        len(staging.free) + len(engine.tiers.shards.buffers()) + len(engine.tiers.grads.buffers())
    )
    largest = max(
        [u.master.nbytes for u in engine.units if u.home is not None]
        + [u.grad_opt.nbytes for u in engine.units if u.grad_home is not None]
    )
    out = staging.live, held, staging.nbytes, largest
    engine.close()
    return out


def test_the_parameter_and_gradient_tiers_share_their_host_buffers(tmp_path):
    """With both per-unit tiers, the reads and writes of both go through one set of
    `offload_buffer_count` buffers (each tier kept a set of its own before, twice the
    memory), each the size of the largest region of either, every one accounted for."""
    for live, held, nbytes, largest in run_world(_staging_after_steps, 2, str(tmp_path)):
        assert 2 <= live <= 3
        assert held == live
        assert nbytes == -(-largest // 4096) * 4096
