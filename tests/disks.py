"""Small real file systems, and a disk that fills mid-training, for the full-disk tests."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import torch

from training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.offload import OffloadError
from zero_strategy.offload import offload_file as offload_file_module


def mount_small_tmpfs(mount: Path, size: str) -> bool:
    """Mount a tmpfs of `size` at `mount` where this process may (root); whether it did."""
    mount.mkdir(exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    return subprocess.run(command, capture_output=True).returncode == 0


def unmount(mount: Path) -> None:
    subprocess.run(["umount", str(mount)], check=True)


def fill_the_disk_mid_training(engine, rank: int, world: int, ckpt: str, failing=None) -> tuple:
    """Two steps, a checkpoint, then steps whose offload writes all fail as on a full disk
    (ENOSPC) on the `failing` ranks (all by default), until a step raises on every rank, a
    save attempted after it, and the checkpoint loaded back: (the step's error message or
    None, the save's or None). A step never waits for its own writes: with the gradient
    shards on disk the first step raises (the backward before it wrote them), with only
    the optimizer's state or the parameters there the second. The engine is left after
    the load."""
    for step in range(2):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    engine.save_checkpoint(ckpt)
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing is None or rank in failing:
        offload_file_module.os.pwrite = full
    message = None
    try:  # the disk stays full until a step has raised
        for step in (2, 3):
            x, y = local_batch(step, 0, rank, world)
            engine.backward(engine(x, y))
            message = _error_of(engine.step, OffloadError)
            if message is not None:
                break
            engine.zero_grad()
    finally:
        offload_file_module.os.pwrite = real
    refused = _error_of(lambda: engine.save_checkpoint(ckpt + "-after"), Exception)
    engine.load_checkpoint(ckpt)
    return message, refused


def fill_the_disk_then_recover(
    config: ZeroConfig, in_memory: ZeroConfig, rank: int, world: int, ckpt: str
) -> tuple:
    """An engine with `config` through `fill_the_disk_mid_training`, then one more step
    (usable again after the load): (the step's error, the save's, whether the weights
    the load restored are the checkpoint's, as an engine with `in_memory` loads them)."""
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), config)
    message, refused = fill_the_disk_mid_training(engine, rank, world, ckpt)
    restored = engine.full_state_dict(rank0_only=False)
    x, y = local_batch(2, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    fresh = make_model()
    again = ZeroEngine(fresh, make_optimizer(fresh), in_memory)
    again.load_checkpoint(ckpt)
    expected = again.full_state_dict(rank0_only=False)
    again.close()
    same = all(torch.equal(restored[k], expected[k]) for k in expected)
    return message, refused, same


def _error_of(action, kind: type[BaseException]) -> str | None:
    try:
        action()
    except kind as e:
        return str(e)
    return None
