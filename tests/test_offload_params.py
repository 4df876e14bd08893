"""Stage 3's parameter shards on disk (offload_params="disk"): training identical to
keeping them in memory, exact figures for what moved, checkpoints that move between the
two at another world size, a failing disk, the memory it frees (measured), and writes
from outside the step. Lightning, Fabric, Accelerate and Hydra, and the file's lifetime,
are tested with the optimizer's tier in test_offload.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_offload import _peak_rss, _save_then_resume

from disks import fill_the_disk_then_recover
from distributed import run_world
from training import local_batch, make_model, make_optimizer, train_zero, train_zero_resumable
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.config import ZeroConfigError
from zero_strategy.offload.offload_file import round_up

STEPS, ACCUM, CLIP = 10, 2, 0.5


def _params_on_disk(directory: Path, **extra) -> dict:
    return {"offload_params": "disk", "offload_dir": str(directory), **extra}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # the optimizer's state on disk too, in small tiles with the fewest buffers
        {"offload_optimizer": "disk", "offload_tile_size": 700, "offload_buffer_count": 2},
        # bf16 compute (a master and a compute copy per shard), the EMA, deeper prefetch
        {"compute_dtype": "bf16", "ema_decay": 0.8, "prefetch_depth": 2},
    ],
    ids=["params", "params+optimizer", "bf16+ema"],
)
def test_param_offload_trains_bit_identically_to_memory(extra, tmp_path):
    """10 steps with accumulation (no_sync) and clipping at stage 3 on 2 ranks: the same
    losses and weights, bit for bit, as the shards kept in memory."""
    memory_extra = {k: v for k, v in extra.items() if not k.startswith("offload")}
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, 3, **memory_extra)
    disk = run_world(train_zero, 2, STEPS, ACCUM, CLIP, 3, **_params_on_disk(tmp_path, **extra))
    (mem_losses, mem_state), (disk_losses, disk_state) = memory[0], disk[0]
    assert disk_losses == mem_losses
    assert all(torch.equal(disk_state[k], mem_state[k]) for k in mem_state)
    assert os.listdir(tmp_path) == []  # the scratch files were never visible, nor are left


def _report_run(rank, world, directory, compute_dtype):
    model = make_model()
    config = ZeroConfig(stage=3, compute_dtype=compute_dtype, **_params_on_disk(directory))
    engine = ZeroEngine(model, make_optimizer(model), config)
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    report = engine.memory_report()
    shards = [u.opt_end - u.opt_start for u in engine.units if not u.persistent]
    buffers = len(engine.tiers.shards.buffers())
    gather_spares = engine.gather.storage_pool.spare_bytes  # stage 3's own pooled memory
    engine.close()
    return report, shards, buffers, gather_spares, engine.stage


@pytest.mark.parametrize("world", [1, 2])
def test_memory_report_counts_the_offloaded_shards_exactly(tmp_path, world):
    """Between steps no shard is in memory: each is in the file, rounded up to 4 KiB
    blocks (fp32: the master is the compute copy; bf16: a master and a copy). One process
    keeps stage 3 here, since its parameters are offloaded unit by unit."""
    for compute_dtype, copy_bytes in (("fp32", 0), ("bf16", 2)):
        for report, shards, buffers, gather_spares, stage in run_world(
            _report_run, world, str(tmp_path), compute_dtype
        ):
            assert stage == 3
            assert report["parameters"] == report["master_params"] == 0
            masters = sum(round_up(4 * n) for n in shards)
            copies = sum(round_up(copy_bytes * n) for n in shards)
            if copy_bytes:
                assert report["disk_master_params"] == masters
                assert report["disk_parameters"] == copies
            else:
                assert report["disk_parameters"] == masters
            assert report["disk_total"] == masters + copies
            # The host buffers, each of the largest shard's region, stay for the next
            # gathers (pooled memory); never more than offload_buffer_count of them.
            largest = max(round_up(4 * n) + round_up(copy_bytes * n) for n in shards)
            assert 1 <= buffers <= 4
            assert report["pooled"] == buffers * largest + gather_spares


@pytest.mark.parametrize(("save_world", "resume_world"), [(2, 1), (1, 2)])
def test_a_checkpoint_moves_between_offloaded_and_resident_shards(
    tmp_path, save_world, resume_world
):
    """Saved with the shards on disk at one world size, resumed with them in memory at
    the other, and the other way round: the continuation is bit for bit the one without
    offload on either side, and within 1e-5 of the run never interrupted."""
    offload = tmp_path / "offload"
    offload.mkdir()
    on_disk = _params_on_disk(offload)
    plain = _save_then_resume(tmp_path, "plain", save_world, {}, resume_world, {})
    # Offloaded at the 2-rank end: one process with its shards offloaded runs stage 3
    # where the plain one is not sharded at all (equal within rounding, not bit for bit).
    saved, resumed = (on_disk, {}) if save_world == 2 else ({}, on_disk)
    moved = _save_then_resume(tmp_path, "moved", save_world, saved, resume_world, resumed)
    assert moved[0] == plain[0]
    assert all(torch.equal(moved[1][k], plain[1][k]) for k in plain[1])
    whole = run_world(train_zero_resumable, 1, 3, range(6), "", False, False)[0]
    assert moved[0] == pytest.approx(whole[0][3:], rel=1e-5)
    num = sum(((moved[1][k] - v) ** 2).sum() for k, v in whole[1].items())
    den = sum((v**2).sum() for v in whole[1].values())
    assert (num / den).sqrt() < 1e-5


def _fails_mid_training(rank, world, directory, ckpt):
    # The file is behind the training after the failed step: the shards are refused
    # until the checkpoint is loaded, then usable again.
    config = ZeroConfig(stage=3, **_params_on_disk(Path(directory)))
    return fill_the_disk_then_recover(config, ZeroConfig(stage=3), rank, world, ckpt)


def test_a_disk_that_fills_fails_the_step_and_a_load_recovers(tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    ckpt = str(tmp_path / "ckpt")
    for message, refused, same in run_world(_fails_mid_training, 2, str(offload), ckpt):
        assert message is not None
        assert f"no space left on the device of offload_dir {offload}" in message
        assert refused is not None and "Load a checkpoint" in refused
        assert same  # the load put every shard back: the weights of the checkpoint
    assert json.loads(Path(ckpt, "index.json").read_text())["step"] == 2


def test_param_offload_outside_stage_3_or_without_a_directory_is_refused():
    with pytest.raises(ZeroConfigError, match=r"offload_params='disk' is invalid: .*stage 3"):
        ZeroConfig(stage=2, offload_params="disk", offload_dir="/tmp")
    with pytest.raises(ZeroConfigError, match=r"offload_dir=None is invalid: offload_params="):
        ZeroConfig(stage=3, offload_params="disk")
    with pytest.raises(ZeroConfigError, match=r"offload_params='nvme' is invalid: use 'none'"):
        ZeroConfig(stage=3, offload_params="nvme")


def test_param_offload_frees_most_of_the_masters_between_steps(tmp_path):
    """25M parameters on one process (100 MB of fp32 masters, which are the parameters),
    the optimizer's state on disk in both runs: with the shards on disk too, the process
    holds at least 60% of the masters' size less between steps (the host buffers keep four
    units' worth, 16 MB), and its peak is lower as well. (The peak falls by less than the
    masters: one process at stage 3 holds up to 64 MiB of gradients in flight during
    backward, which the unsharded run without parameter offload does not.)"""
    optimizer_on_disk = {
        "offload_optimizer": "disk",
        "offload_dir": str(tmp_path),
        "offload_tile_size": 1_000_000,
    }
    state_only = _peak_rss({"stage": 3, **optimizer_on_disk}, tmp_path / "a")
    both = _peak_rss({"stage": 3, "offload_params": "disk", **optimizer_on_disk}, tmp_path / "b")
    masters = 4 * 24 * (1024 * 1024 + 1024)
    assert both["disk_parameters"] >= masters
    drop = state_only["rss_between_steps"] - both["rss_between_steps"]
    assert drop >= 0.6 * masters, (state_only, both)
    assert both["training_peak_rss"] < state_only["training_peak_rss"], (state_only, both)


def test_moe_experts_shards_on_disk_train_identically(tmp_path):
    """Expert units (sharded over their expert-data-parallel groups) go to the file like
    any other: 2 ranks, experts split over both (ep 2), stage 3."""
    from test_moe import _train

    memory = run_world(_train, 2, 2, 3)[0]
    disk = run_world(_train, 2, 2, 3, **_params_on_disk(tmp_path))[0]
    assert disk[0] == memory[0]
    assert all(torch.equal(disk[1][k], memory[1][k]) for k in memory[1])


def _writes_from_outside(rank, world, directory, offloaded):
    """Weights written through gathered_parameters (rank 1's, broadcast) and through
    load_state_dict, bf16 compute, then one more step."""
    extra = _params_on_disk(Path(directory)) if offloaded else {}
    model = make_model()
    config = ZeroConfig(stage=3, compute_dtype="bf16", **extra)
    engine = ZeroEngine(model, make_optimizer(model), config)
    for step in range(2):
        if step == 1:
            block = engine.module.blocks[1]
            with engine.gathered_parameters(block, modifier_rank=1), torch.no_grad():
                for p in block.parameters():
                    p.data.fill_(0.5 if rank == 1 else -7.0)
            model.blocks[0].load_state_dict(make_model(seed=1).blocks[0].state_dict())
            written = engine.full_state_dict(rank0_only=False)
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    final = engine.full_state_dict(rank0_only=False)
    engine.close()
    return written, final


def test_writes_from_outside_reach_the_offloaded_shards(tmp_path):
    """gathered_parameters and load_state_dict write into shards that live on disk: the
    masters take the values, and training goes on exactly as with the shards in memory."""
    memory = run_world(_writes_from_outside, 2, str(tmp_path), False)
    disk = run_world(_writes_from_outside, 2, str(tmp_path), True)
    donor = make_model(seed=1).blocks[0].state_dict()
    for (mem_written, mem_final), (written, final) in zip(memory, disk):
        for name, value in donor.items():
            assert torch.equal(written[f"blocks.0.{name}"], value), name
        assert all((v == 0.5).all() for k, v in written.items() if k.startswith("blocks.1."))
        assert all(torch.equal(written[k], mem_written[k]) for k in mem_written)
        assert all(torch.equal(final[k], mem_final[k]) for k in mem_final)


def test_a_hugging_face_llama_with_recomputation_trains_like_ddp(tmp_path):
    """Llama (transformers) with activation recomputation, its shards on disk: the
    recomputed forwards inside backward read their units again, and losses and weights
    are DDP's to the bit."""
    pytest.importorskip("transformers")
    from test_hf_models import _assert_trains_like_ddp

    _assert_trains_like_ddp("llama", 3, checkpointing="non-reentrant", **_params_on_disk(tmp_path))
