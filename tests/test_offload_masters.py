"""The fp32 masters on disk with the optimizer's state (offload_optimizer="disk" in bf16 or
fp16, any stage): training identical to keeping them in memory, at stages 1-3, with fp16
loss scaling, and at stage 3 beside the parameters' tier (which then keeps the compute
copies alone); the memory and disk figures, exactly; a checkpoint that moves to a run
without offload at another world size; and a disk that fills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disks import fill_the_disk_then_recover
from distributed import run_world
from training import local_batch, make_model, make_optimizer, train_zero, train_zero_resumable
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.offload.offload_file import round_up

STEPS, ACCUM, CLIP = 10, 2, 0.5
# Small tiles and the fewest buffers: many tiles per step, each buffer reused while the
# previous write may still be in flight.
SMALL = {"offload_tile_size": 700, "offload_buffer_count": 2}


def _disk(directory, **extra) -> dict:
    return {"offload_optimizer": "disk", "offload_dir": str(directory), **SMALL, **extra}


@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        (1, {"compute_dtype": "bf16"}),
        (2, {"compute_dtype": "bf16"}),
        (3, {"compute_dtype": "bf16"}),
        (2, {"compute_dtype": "fp16"}),
        (3, {"compute_dtype": "bf16", "offload_params": "disk"}),
    ],
    ids=["stage1-bf16", "stage2-bf16", "stage3-bf16", "stage2-fp16", "stage3-bf16-params"],
)
def test_masters_on_disk_train_bit_identically_to_memory(stage, extra, tmp_path):
    """10 steps of 2 micro-batches (no_sync), clipping at 0.5, two param groups: the same
    losses and weights, bit for bit, as the masters and the state in memory."""
    dtype = {"compute_dtype": extra["compute_dtype"]}
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage, **dtype)
    disk = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage, **_disk(tmp_path, **extra))
    (mem_losses, mem_state), (disk_losses, disk_state) = memory[0], disk[0]
    assert disk_losses == mem_losses
    assert all(torch.equal(disk_state[k], mem_state[k]) for k in mem_state)


def _figures(rank, world, stage, directory, extra):
    """Two steps, the peaks reset, a third step: the memory report after it, and the
    bytes each tier's file should hold, from the units' own tensors."""
    model = make_model()
    config = ZeroConfig(stage=stage, compute_dtype="bf16", **_disk(directory, **extra))
    engine = ZeroEngine(model, make_optimizer(model), config)
    for step in range(3):
        if step == 2:
            engine.reset_memory_peaks()
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    report = engine.memory_report()
    units = [u for u in engine.units if u.master.numel()]
    expected = {
        "masters": sum(round_up(u.master.nbytes) for u in units),
        "largest_master": max(u.master.nbytes for u in units),
        "compute_copies": sum(round_up(u.shard.nbytes) for u in units if not u.persistent),
    }
    engine.close()
    return report, expected


@pytest.mark.parametrize(
    ("stage", "extra"), [(2, {}), (3, {"offload_params": "disk"})], ids=["stage2", "stage3-params"]
)
def test_memory_and_disk_figures_with_the_masters_on_disk(stage, extra, tmp_path):
    """No master in memory between steps, at most one unit's during the step (the peak is
    exactly the largest), and each file holds exactly its tensors: at stage 3 the
    parameters' file holds the bf16 compute copies alone (what a gather reads), the fp32
    masters are in the masters' file."""
    for report, expected in run_world(_figures, 2, stage, str(tmp_path), extra):
        assert report["master_params"] == 0
        assert report["peak_master_params"] == expected["largest_master"]
        assert report["disk_master_params"] == expected["masters"]
        if stage == 3:
            assert report["disk_parameters"] == expected["compute_copies"]
        assert report["disk_total"] == sum(
            report[f"disk_{kind}"]
            for kind in ("parameters", "master_params", "gradients", "optimizer_state")
        )


def test_a_checkpoint_with_the_masters_on_disk_resumes_at_world_1_without_offload(tmp_path):
    """Saved at world 2 (stage 2, bf16) with the masters and state on disk, resumed at
    world 1 with everything in memory: bit for bit the continuation of the run that never
    offloaded."""
    offload = tmp_path / "offload"
    offload.mkdir()
    bf16 = {"compute_dtype": "bf16"}

    def save_then_resume(name, save_extra):
        ckpt = str(tmp_path / name)
        run_world(train_zero_resumable, 2, 2, range(3), ckpt, False, True, **save_extra)
        return run_world(train_zero_resumable, 1, 2, range(3, 6), ckpt, True, False, **bf16)[0]

    plain = save_then_resume("plain", bf16)
    moved = save_then_resume("moved", {**bf16, **_disk(offload)})
    assert moved[0] == plain[0]
    assert all(torch.equal(moved[1][k], plain[1][k]) for k in plain[1])


def _fills(rank, world, directory, ckpt):
    config = ZeroConfig(stage=1, compute_dtype="bf16", **_disk(Path(directory)))
    in_memory = ZeroConfig(stage=1, compute_dtype="bf16")
    return fill_the_disk_then_recover(config, in_memory, rank, world, ckpt)


def test_a_disk_that_fills_with_the_masters_on_it_fails_the_step_and_a_load_recovers(tmp_path):
    """Stage 1 in bf16, the masters and the state on disk: the step after the disk fills
    fails on every rank naming the directory, a save is refused, and loading the last
    checkpoint puts its masters back (the weights of the checkpoint) and trains again."""
    offload = tmp_path / "offload"
    offload.mkdir()
    ckpt = str(tmp_path / "ckpt")
    for message, refused, same in run_world(_fills, 2, str(offload), ckpt):
        assert message is not None
        assert f"no space left on the device of offload_dir {offload}" in message
        assert refused is not None and "Load a checkpoint" in refused
        assert same
