"""A long stage-3 run holds steady: what it holds after warm-up is what it holds at the end
(RSS, open files, threads, process groups, the engine's own tensors), across thousands of
steps and a checkpoint every 100."""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

from distributed import run_world
from training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine

STEPS, WARMUP, SAVE_EVERY = 1500, 300, 100


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held(engine: ZeroEngine) -> dict[str, int]:
    return {
        "rss": _rss_bytes(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "process_groups": len(dist.distributed_c10d._world.pg_map),
        "engine_bytes": sum(engine.memory_report().values()),
    }


def _long_run(rank: int, world: int, ckpt: str):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, gradient_clipping=1.0))
    after_warmup = None
    for step in range(STEPS):
        x, y = local_batch(step % 50, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
        if (step + 1) % SAVE_EVERY == 0:
            engine.save_checkpoint(ckpt)
        if step + 1 == WARMUP:
            after_warmup = _held(engine)
    return after_warmup, _held(engine)


def test_a_1500_step_stage3_run_with_checkpoints_holds_steady(tmp_path):
    for rank, (start, end) in enumerate(
        run_world(_long_run, 2, str(tmp_path / "ckpt"), timeout=900)
    ):
        print(f"rank {rank}: after {WARMUP} steps {start}; after {STEPS} {end}")
        assert end["rss"] < 1.02 * start["rss"], (start, end)
        # A forked rank inherits the test process's open files; the collector may close
        # those it no longer references mid-run. A leak adds descriptors, never removes.
        assert end["fds"] <= start["fds"], (start, end)
        for kind in ("threads", "os_threads", "process_groups", "engine_bytes"):
            assert end[kind] == start[kind], (kind, start, end)
