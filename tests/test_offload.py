"""The optimizer's state on disk (offload_optimizer="disk"): training identical to keeping
it in memory, at every stage; checkpoints that move between the two at any world size;
the memory it frees, measured; and clear errors for a directory that cannot be used or a
disk that fills. The doors (Lightning, Fabric, Accelerate, Hydra) and the file's lifetime
are tested here for the parameters' tier too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from disks import fill_the_disk_mid_training, mount_small_tmpfs, unmount
from distributed import run_world
from training import (
    local_batch,
    make_model,
    make_optimizer,
    train_zero,
    train_zero_resumable,
)
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.config import ZeroConfigError
from zero_strategy.offload import OffloadError
from zero_strategy.offload import offload_file as offload_file_module
from zero_strategy.offload.offload_file import round_up

STEPS, ACCUM, CLIP = 10, 2, 0.5
# Small tiles and the fewest buffers: many tiles per step, each buffer reused while the
# previous write may still be in flight.
SMALL_TILES = {"offload_tile_size": 700, "offload_buffer_count": 2}


def _disk(tmp_path: Path, **extra) -> dict:
    return {"offload_optimizer": "disk", "offload_dir": str(tmp_path), **SMALL_TILES, **extra}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_disk_offload_trains_bit_identically_to_memory(stage, tmp_path):
    """10 steps with accumulation (no_sync) and clipping: the same losses and weights,
    bit for bit, as the optimizer state kept in memory."""
    memory = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage)
    disk = run_world(train_zero, 2, STEPS, ACCUM, CLIP, stage, **_disk(tmp_path))
    (mem_losses, mem_state), (disk_losses, disk_state) = memory[0], disk[0]
    assert disk_losses == mem_losses
    assert all(torch.equal(disk_state[k], mem_state[k]) for k in mem_state)
    assert os.listdir(tmp_path) == []  # the scratch files were never visible, nor are left


def test_disk_offload_in_one_process_with_bf16_and_ema(tmp_path):
    """World 1, bf16 compute with fp32 masters and the sharded EMA (a state key added
    after the first step, so the tier lays the state out again): identical to memory."""

    def run(**extra):
        model = make_model()
        engine = ZeroEngine(
            model,
            make_optimizer(model),
            ZeroConfig(
                stage=3, compute_dtype="bf16", ema_decay=0.8, gradient_clipping=CLIP, **extra
            ),
        )
        for step in range(4):
            x, y = local_batch(step, 0, 0, 1)
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
        weights = engine.full_state_dict()
        with engine.ema_weights():
            averaged = engine.full_state_dict()
        report = engine.memory_report()
        report["views"] = len(engine.optim.views)
        # Each unit's fp32 master, a tensor of its own in bf16, at a 4 KiB-aligned place.
        report["masters_aligned"] = sum(round_up(u.master.nbytes) for u in engine.units)
        engine.close()
        return weights, averaged, report

    mem_weights, mem_ema, mem_report = run()
    disk_weights, disk_ema, disk_report = run(**_disk(tmp_path))
    assert all(torch.equal(disk_weights[k], mem_weights[k]) for k in mem_weights)
    assert all(torch.equal(disk_ema[k], mem_ema[k]) for k in mem_ema)
    # exp_avg, exp_avg_sq and the EMA, fp32, one per master element: all on disk; only
    # each view's step count (a 4-byte scalar) stays in memory.
    assert disk_report["optimizer_state"] == 4 * disk_report["views"]
    assert disk_report["disk_optimizer_state"] >= mem_report["optimizer_state"]
    # The fp32 masters are on disk with the state: none in memory between steps.
    assert mem_report["master_params"] > 0
    assert disk_report["master_params"] == 0
    assert disk_report["disk_master_params"] == disk_report["masters_aligned"]
    assert disk_report["disk_total"] == (
        disk_report["disk_optimizer_state"] + disk_report["disk_master_params"]
    )
    assert mem_report["disk_total"] == 0


def _file_bytes(directory: Path) -> int:
    """The size of this process's (unlinked) offload file under `directory`."""
    (fd,) = _open_under(directory)
    return os.fstat(int(fd.name)).st_size


def test_a_state_laid_out_again_reuses_the_space_it_left(tmp_path):
    """An EMA started after two steps adds a key to every view's state: each view is laid
    out again, larger, and the space of its old layout goes to the next ones. The file
    ends at exactly the new layouts' size (it used to keep both), and the EMA is the one
    kept in memory."""

    def run(**extra):
        model = make_model()
        engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=1, **extra))
        sizes = []
        for step in range(4):
            x, y = local_batch(step, 0, 0, 1)
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
            if step >= 1:
                engine.update_ema(0.9)
            if extra:
                sizes.append((_file_bytes(tmp_path), engine.memory_report()["disk_total"]))
        with engine.ema_weights():
            averaged = engine.full_state_dict()
        engine.close()
        return averaged, sizes

    in_memory, _ = run()
    on_disk, sizes = run(**_disk(tmp_path))
    assert all(torch.equal(on_disk[k], in_memory[k]) for k in in_memory)
    (before, state_before), *after = sizes
    assert before == state_before
    for file_bytes, state_bytes in after:
        assert state_bytes == before * 3 // 2  # exp_avg, exp_avg_sq, then the EMA too
        assert file_bytes == state_bytes


def _report_run(rank, world, stage, directory):
    model = make_model()
    config = ZeroConfig(stage=stage, offload_optimizer="disk", offload_dir=directory)
    engine = ZeroEngine(model, make_optimizer(model), config)
    before = engine.memory_report()
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    after = engine.memory_report()
    time.sleep(0.5)  # the step's last write (a few KiB) is done
    with torch.no_grad():
        engine(x, y)  # a forward lets go of the finished writes' buffers
    later = engine.memory_report()
    views = [v.hi - v.lo for v in engine.optim.views]
    engine.close()
    return before, after, later, views


def test_memory_report_counts_the_disk_tier_exactly(tmp_path):
    """After the first step each optimizer view's exp_avg and exp_avg_sq (fp32) sit in
    the file, each rounded up to the 4 KiB blocks the file hands out; only the views' step
    counts (4-byte scalars) stay in memory, and the tier's host buffers are given back
    after the step, but for the last write's until it is done (their peak is in
    `peak_pooled`)."""
    for before, after, later, views in run_world(_report_run, 2, 1, str(tmp_path)):
        assert before["disk_optimizer_state"] == 0
        assert after["optimizer_state"] == 4 * len(views)
        blocks = [2 * (-(-4 * n // 4096) * 4096) for n in views]
        assert after["disk_optimizer_state"] == after["disk_total"] == sum(blocks)
        assert after["pooled"] in (0, sum(blocks))  # the last write's buffer, if going
        assert later["pooled"] == 0
        # One tile here: the first step packs it into one buffer of all its regions, and
        # the exact peak saw it.
        assert after["peak_pooled"] == sum(blocks)


def _hooked_run(rank, world, directory):
    """A pre-hook that halves every gradient and a post-hook that looks at the state: the
    same weights with the state on disk as in memory, each hook once per step."""
    results = {}
    for name, extra in (("memory", {}), ("disk", _disk(Path(directory)))):
        model = make_model()
        optimizer = make_optimizer(model)
        calls = []

        def halve(opt, args, kwargs, calls=calls):
            params = [p for g in opt.param_groups for p in g["params"]]
            calls.append(("pre", sum(p.grad is not None for p in params)))
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(0.5)

        def look(opt, args, kwargs, calls=calls):
            meta = any(v.is_meta for s in opt.state.values() for v in s.values())
            calls.append(("post", meta))

        optimizer.register_step_pre_hook(halve)
        optimizer.register_step_post_hook(look)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, **extra))
        for step in range(2):
            x, y = local_batch(step, 0, rank, world)
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
        views = len(engine.optim.views)
        tiles = len(getattr(engine.optim.state_store, "tiles", [[]]))
        results[name] = (calls, engine.full_state_dict(), views, tiles)
        engine.close()
    return results


def test_the_users_step_hooks_run_once_per_step_over_many_tiles(tmp_path):
    """Pre-hooks see every gradient (and may change them), post-hooks the state: with
    the state on disk the step runs a tile at a time, the hooks once around all tiles."""
    for rank, results in enumerate(run_world(_hooked_run, 2, str(tmp_path))):
        (mem_calls, mem_weights, mem_views, _), (calls, weights, views, tiles) = (
            results["memory"],
            results["disk"],
        )
        assert tiles >= 3
        assert calls == [("pre", views), ("post", True)] * 2  # state on disk: meta there
        assert mem_calls == [("pre", mem_views), ("post", False)] * 2
        if rank == 0:
            assert all(torch.equal(weights[k], mem_weights[k]) for k in mem_weights)


def _save_then_resume(tmp_path, name, save_world, save_extra, resume_world, resume_extra):
    ckpt = str(tmp_path / name)
    run_world(train_zero_resumable, save_world, 3, range(3), ckpt, False, True, **save_extra)
    return run_world(
        train_zero_resumable, resume_world, 3, range(3, 6), ckpt, True, False, **resume_extra
    )[0]


@pytest.mark.parametrize(("save_world", "resume_world"), [(2, 1), (1, 2)])
def test_a_checkpoint_moves_between_disk_and_memory_at_another_world_size(
    tmp_path, save_world, resume_world
):
    """Saved with the state on disk at world 2 (stage 3), resumed with it in memory at
    world 1, and the other way round: the continuation is bit for bit the one without
    offload on either side, and within 1e-5 of the run never interrupted."""
    offload = tmp_path / "offload"
    offload.mkdir()
    on_disk = _disk(offload)
    plain = _save_then_resume(tmp_path, "plain", save_world, {}, resume_world, {})
    if save_world == 2:
        moved = _save_then_resume(tmp_path, "moved", save_world, on_disk, resume_world, {})
    else:
        moved = _save_then_resume(tmp_path, "moved", save_world, {}, resume_world, on_disk)
    assert moved[0] == plain[0]
    assert all(torch.equal(moved[1][k], plain[1][k]) for k in plain[1])
    whole = run_world(train_zero_resumable, 1, 3, range(6), "", False, False)[0]
    assert moved[0] == pytest.approx(whole[0][3:], rel=1e-5)
    num = sum(((moved[1][k] - v) ** 2).sum() for k, v in whole[1].items())
    den = sum((v**2).sum() for v in whole[1].values())
    assert (num / den).sqrt() < 1e-5


def test_checkpoints_with_and_without_offload_hold_the_same_tensors(tmp_path):
    """The same training saved from disk and from memory: identical files' tensors."""
    from safetensors.torch import load_file

    from zero_strategy.checkpoint.safetensors_io import SafetensorsFile

    offload = tmp_path / "offload"
    offload.mkdir()
    for name, extra in (("memory", {}), ("disk", _disk(offload))):
        run_world(train_zero_resumable, 2, 1, range(2), str(tmp_path / name), False, True, **extra)
    for rank in (0, 1):
        a = SafetensorsFile(tmp_path / "memory" / f"rank{rank:05d}.safetensors")
        b = SafetensorsFile(tmp_path / "disk" / f"rank{rank:05d}.safetensors")
        assert sorted(a.keys()) == sorted(b.keys())
        assert any(k.startswith("exp_avg_sq/") for k in a.keys())  # noqa: SIM118
        assert all(torch.equal(a.read(k), b.read(k)) for k in a.keys())  # noqa: SIM118
        whole = load_file(tmp_path / "disk" / f"rank{rank:05d}.safetensors")  # safetensors'
        assert all(torch.equal(whole[k], a.read(k).view(whole[k].shape)) for k in whole)


# ---------------------------------------------------------------- bad input, full disks
def test_disk_offload_without_a_directory_is_refused():
    with pytest.raises(ZeroConfigError, match=r"offload_dir=None is invalid: .*needs a directory"):
        ZeroConfig(offload_optimizer="disk")
    with pytest.raises(ZeroConfigError, match=r"offload_optimizer='nvme' is invalid: use 'none'"):
        ZeroConfig(offload_optimizer="nvme")


def test_a_missing_or_unusable_directory_is_named(tmp_path, monkeypatch):
    model = make_model()
    missing = tmp_path / "nope"
    with pytest.raises(OffloadError, match=rf"offload_dir {missing} does not exist.*mkdir -p"):
        ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=0, **_disk(missing)))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OffloadError, match=rf"offload_dir {a_file} does not exist or is not a"):
        ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=0, **_disk(a_file)))
    # Read-only for this process (root writes anywhere, so the permission check is told).
    monkeypatch.setattr(offload_file_module.os, "access", lambda path, mode: False)
    with pytest.raises(OffloadError, match=rf"offload_dir {tmp_path} is not writable by this"):
        ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=0, **_disk(tmp_path)))


def test_a_disk_too_small_for_the_state_fails_the_first_step_naming_it(tmp_path):
    """On a real 64 KiB file system (where one can be mounted): the state's space is
    reserved at the first step, and that fails naming the directory and the bytes."""
    mount = tmp_path / "small"
    if not mount_small_tmpfs(mount, "64k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        model = make_model()
        engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=0, **_disk(mount)))
        x, y = local_batch(0, 0, 0, 1)
        engine.backward(engine(x, y))
        with pytest.raises(
            OffloadError, match=rf"no space left on the device of offload_dir {mount}"
        ):
            engine.step()
        engine.release_module()  # the engine is done: its file is closed
    finally:
        unmount(mount)


def _fails_mid_training(rank, world, directory, ckpt, failing=None):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=2, **_disk(Path(directory))))
    # The file is behind the optimizer after the failed writes: a save would write stale
    # state, and refuses; loading the checkpoint makes the engine whole again.
    message, refused = fill_the_disk_mid_training(engine, rank, world, ckpt, failing)
    x, y = local_batch(2, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    fresh = make_model()
    again = ZeroEngine(fresh, make_optimizer(fresh), ZeroConfig(stage=2))
    again.load_checkpoint(ckpt)
    loaded = again.global_steps
    again.close()
    return message, loaded, refused


def test_a_disk_that_fills_mid_training_fails_the_step_and_keeps_the_checkpoint(tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    ckpt = str(tmp_path / "ckpt")
    for message, loaded, refused in run_world(_fails_mid_training, 2, str(offload), ckpt):
        assert refused is not None and "incomplete since a step failed" in refused
        assert "Load a checkpoint" in refused
        assert message is not None
        assert f"no space left on the device of offload_dir {offload}" in message
        assert "checkpoints already written are not affected" in message
        assert loaded == 2
    assert json.loads(Path(ckpt, "index.json").read_text())["step"] == 2


def test_a_disk_that_fills_on_one_rank_fails_every_rank_together(tmp_path):
    """Only rank 1's writes fail. Every rank raises at the next step (none waits in a
    collective for it until the timeout): rank 1 its own error, rank 0 naming rank 1;
    both refuse to save and recover by loading the checkpoint."""
    offload = tmp_path / "offload"
    offload.mkdir()
    ckpt = str(tmp_path / "ckpt")
    start = time.monotonic()
    ranks = run_world(_fails_mid_training, 2, str(offload), ckpt, {1})
    assert time.monotonic() - start < 60
    (message0, loaded0, refused0), (message1, loaded1, refused1) = ranks
    assert f"no space left on the device of offload_dir {offload}" in message1
    assert "an offload write failed on rank(s) [1]" in message0
    assert "Load a checkpoint" in message0
    for refused in (refused0, refused1):
        assert refused is not None and "incomplete since a step failed" in refused
    assert loaded0 == loaded1 == 2


def test_the_step_does_not_wait_for_its_last_writes(tmp_path):
    """With writes slowed to 0.6 s each, step() returns while its last writes are still
    going (they finish during the next forward); training is the same as in memory."""
    finished: list[float] = []
    real = os.pwrite

    def slow(fd, data, offset):
        time.sleep(0.6)
        written = real(fd, data, offset)
        finished.append(time.monotonic())
        return written

    model = make_model()
    config = ZeroConfig(stage=1, offload_optimizer="disk", offload_dir=str(tmp_path))
    engine = ZeroEngine(model, make_optimizer(model), config)
    reference = make_model()
    plain = ZeroEngine(reference, make_optimizer(reference), ZeroConfig(stage=1))
    offload_file_module.os.pwrite = slow
    try:
        for step in range(4):
            x, y = local_batch(step, 0, 0, 1)
            engine.backward(engine(x, y))
            engine.step()  # it waits for the last step's writes, done by now
            done_when_it_returned = len(finished)
            engine.zero_grad()
            plain.backward(plain(x, y))
            plain.step()
            plain.zero_grad()
            time.sleep(1.0)
            # A write of this step finished after it returned: it did not wait for it.
            assert len(finished) > done_when_it_returned, step
        engine.close()  # waits for the last writes
    finally:
        offload_file_module.os.pwrite = real
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    plain.close()


# ---------------------------------------------------------------- memory, measured
PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    from zero_strategy import ZeroConfig, ZeroEngine
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    config = ZeroConfig(**{"stage": 0, **json.loads(sys.argv[1])})
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), config)
    # The peak of the training alone, from here on (Linux: "5" resets the high-water mark).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(2):
        engine.backward(engine.module(torch.randn(4, 1024)).square().mean())
        engine.step()
        engine.zero_grad()
    report = engine.memory_report()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    training_peak_rss = int(line.split()[1]) * 1024
    # The save: sampled every millisecond, against the resident size just before it.
    import psutil, threading, time
    process, samples, done = psutil.Process(), [], threading.Event()
    def sample():
        while not done.is_set():
            samples.append(process.memory_info().rss)
            time.sleep(0.001)
    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    engine.save_checkpoint(sys.argv[2])
    done.set()
    sampler.join()
    engine.close()
    print(json.dumps({"peak_rss": peak_rss, "training_peak_rss": training_peak_rss,
                      "rss_between_steps": before,
                      "save_growth": max(samples) - before,
                      "disk": report["disk_optimizer_state"],
                      "disk_parameters": report["disk_parameters"],
                      "state": report["optimizer_state"], "views": len(engine.optim.views)}))
    """
)


def _peak_rss(extra: dict, checkpoint: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT, json.dumps(extra), str(checkpoint)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disk_offload_lowers_peak_rss_by_most_of_the_optimizer_state(tmp_path):
    """A 25M-parameter model (200 MB of Adam state): the run with the state on disk peaks
    at least 80% of that below the run with it in memory (each in its own process)."""
    memory = _peak_rss({}, tmp_path / "memory")
    disk = _peak_rss(
        {"offload_optimizer": "disk", "offload_dir": str(tmp_path), "offload_tile_size": 1_000_000},
        tmp_path / "disk",
    )
    # Each optimizer view keeps its step count (a 4-byte scalar) in memory; on disk the
    # views are cut into tiles, so there are more of them.
    state = memory["state"] - 4 * memory["views"]  # exp_avg and exp_avg_sq, fp32
    assert state == 2 * 4 * 24 * (1024 * 1024 + 1024)
    assert disk["state"] == 4 * disk["views"] and disk["disk"] >= state
    assert memory["peak_rss"] - disk["peak_rss"] >= 0.8 * state, (memory, disk)
    # Saving streams the state from disk into the file one tensor at a time: the process
    # grows by a few 4 MB pieces (the state whole would be 200 MB more, the masters 100).
    assert disk["save_growth"] <= 0.25 * state, (memory, disk)
    assert memory["save_growth"] <= 0.25 * state, (memory, disk)


# ---------------------------------------------------------------- the doors
@pytest.mark.parametrize(
    ("params", "precision"),
    [(False, "32-true"), (True, "32-true"), (False, "16-mixed")],
    ids=["state", "state+params", "fp16-state+masters"],
)
def test_lightning_trains_identically_with_the_state_on_disk(tmp_path, params, precision):
    """The optimizer's state on disk, and stage 3's parameter shards too; with
    `precision="16-mixed"` (fp16 compute, loss scaling) the fp32 masters go with the
    state."""
    pytest.importorskip("lightning")
    from lightning_helpers import fit

    from zero_strategy.integrations.lightning import ZeroStrategy

    plain = run_world(fit, 2, "zero3", precision=precision)
    extra = {"offload_params": "disk"} if params else {}
    strategy = ZeroStrategy(stage=3, **_disk(tmp_path), **extra)
    disk = run_world(fit, 2, strategy, precision=precision)
    assert [r["losses"] for r in disk] == [r["losses"] for r in plain]


def test_fabric_accelerate_and_hydra_take_the_fields(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    pytest.importorskip("hydra")
    from hydra.utils import instantiate
    from test_hydra import _compose

    from zero_strategy.integrations.accelerate import ZeroPlugin
    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    fields = {
        "offload_optimizer": "disk",
        "offload_params": "disk",
        "offload_dir": str(tmp_path),
        "offload_tile_size": 9,
    }
    fabric = ZeroFabricStrategy(stage=3, **fields)._zero_base
    accelerate = ZeroPlugin(stage=3, options=fields).resolve("no")
    cfg = _compose(
        "trainer/strategy=zero3",
        "trainer.strategy.offload_optimizer=disk",
        "trainer.strategy.offload_params=disk",
        f"trainer.strategy.offload_dir={tmp_path}",
        "trainer.strategy.offload_tile_size=9",
        "trainer.devices=1",
        "hydra.runtime.output_dir=/tmp",
    )
    hydra = instantiate(cfg.trainer.strategy).engine_config
    for config in (fabric, accelerate, hydra):
        assert (config.offload_optimizer, config.offload_dir) == ("disk", str(tmp_path))
        assert (config.offload_params, config.offload_tile_size) == ("disk", 9)


@pytest.mark.parametrize(
    ("kind", "files", "release"),
    [("state", 1, False), ("params", 1, False), ("everything", 4, True)],
)
def test_a_dropped_or_released_engine_closes_its_files(tmp_path, kind, files, release):
    """The files (the optimizer state's, the parameter shards'; in bf16 with everything
    offloaded the masters' and the gradient shards' too) are held open (unlinked) by the
    engine alone: dropping the engine, or handing its module back (`release_module`: the
    engine is done), closes them, and the finalizer that does so does not keep the engine
    alive."""
    import gc

    def open_files() -> list[str]:
        return [_link(fd) for fd in _open_under(tmp_path)]

    model = make_model()
    offload = {
        "state": {"stage": 0, **_disk(tmp_path)},
        "params": {"stage": 3, "offload_params": "disk", "offload_dir": str(tmp_path)},
        "everything": {
            "stage": 3,
            "compute_dtype": "bf16",
            "offload_params": "disk",
            **_disk(tmp_path),
        },
    }[kind]
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(**offload))
    x, y = local_batch(0, 0, 0, 1)
    engine.backward(engine(x, y))
    engine.step()
    assert len(open_files()) == files and all("(deleted)" in f for f in open_files())
    if release:
        engine.release_module()
        assert open_files() == []
    del engine, model
    gc.collect()
    assert open_files() == []


def _open_under(directory: Path) -> list[Path]:
    """This process's file descriptors open on files under `directory`."""
    return [fd for fd in list(Path("/proc/self/fd").iterdir()) if str(directory) in _link(fd)]


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed since it was listed
        return ""


def _two_optimizers_run(rank, world, ckpt, load, save, steps, extra):
    """AdamW over the blocks, SGD with momentum over the rest: two kinds of state."""
    model = make_model()
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    optimizers = [torch.optim.AdamW(blocks, lr=3e-3), torch.optim.SGD(rest, lr=0.05, momentum=0.9)]
    engine = ZeroEngine(model, optimizers, ZeroConfig(stage=3, **extra))
    if load:
        engine.load_checkpoint(ckpt)
    for step in steps:
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    if save:
        engine.save_checkpoint(ckpt)
    weights = engine.full_state_dict()
    engine.close()
    return weights


@pytest.mark.parametrize("offload", [False, True])
def test_two_kinds_of_optimizer_state_save_and_resume(tmp_path, offload):
    """A checkpoint of AdamW and SGD-momentum state (each parameter has one kind) loads
    back and continues bit for bit as the run never interrupted, with the state in memory
    or on disk."""
    extra = _disk(tmp_path) if offload else {}
    ckpt = str(tmp_path / "ckpt")
    whole = run_world(_two_optimizers_run, 2, "", False, False, range(4), extra)[0]
    run_world(_two_optimizers_run, 2, ckpt, False, True, range(2), extra)
    resumed = run_world(_two_optimizers_run, 2, ckpt, True, False, range(2, 4), extra)[0]
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


class _ReEnteringAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


def test_an_optimizer_whose_step_re_enters_a_hooked_step_is_refused_when_stepped_in_tiles(
    tmp_path,
):
    """A step taken in tiles runs the optimizer's own step without torch's hook wrapper;
    one that calls a base class's (hooked) step would run the step hooks per tile. Refused,
    naming the cause, rather than running the user's hooks several times a step."""
    from zero_strategy import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])  # the base class's step is hooked
    model = torch.nn.Linear(4, 4)
    opt = _ReEnteringAdamW(model.parameters(), lr=0.1)
    cfg = ZeroConfig(
        stage=1,
        offload_optimizer="disk",
        offload_dir=str(tmp_path),
        allow_untested_optimizer=True,
    )
    engine = ZeroEngine(model, opt, cfg)
    try:
        engine.backward(model(torch.ones(2, 4)).sum())
        with pytest.raises(RuntimeError, match=r"super\(\).step\(\)"):
            engine.step()
    finally:
        engine.close()


def _hooks_of_a_step_with_nothing_to_take(rank, world, directory):
    seen = {}
    for name, extra in (("memory", {}), ("disk", _disk(Path(directory)))):
        model = make_model()
        optimizer = make_optimizer(model)
        counts = []

        def count(opt, args, kwargs, counts=counts):
            counts.append(sum(p.grad is not None for g in opt.param_groups for p in g["params"]))

        optimizer.register_step_pre_hook(count)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, **extra))
        x, y = local_batch(0, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
        engine.step()  # no gradient since zero_grad(): torch's hooks see every .grad None
        seen[name] = (counts, len(engine.optim.views))
        engine.close()
    return seen


def test_step_hooks_see_no_gradient_on_a_step_with_nothing_to_take(tmp_path):
    """A step with no gradient since `zero_grad()`: the user's pre-hook finds every
    `.grad` None, as torch's optimizer shows it, whether the step runs whole or (state on
    disk) a tile at a time with the hooks run around the tiles."""
    for seen in run_world(_hooks_of_a_step_with_nothing_to_take, 2, str(tmp_path)):
        for name, (counts, views) in seen.items():
            assert counts == [views, 0], name
