"""The test harness itself (tests/distributed.py): what it promises the tests built on it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from distributed import run_world


def _gloo_worker_threads() -> int:
    tasks = Path("/proc/self/task").iterdir()
    return [(t / "comm").read_text().strip() for t in tasks].count("pt_gloo_runloop")


def _ddp_outlives_the_default_group(rank, world):
    """Accelerate's `end_training()` order: the default group destroyed, DDP still alive."""
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    dist.destroy_process_group()
    alive = _gloo_worker_threads()
    del ddp  # the Reducer's reference to the group goes, with the GIL held
    return {"after destroy": alive, "after ddp": _gloo_worker_threads()}


def test_a_rank_holds_its_world_group_so_a_ddp_reducer_never_frees_it():
    """Freed by a DDP Reducer (the GIL held), a gloo group can deadlock with its own worker
    thread: the hangs CI saw. The rank's own reference keeps the group, and its threads,
    alive until the harness lets go of it from Python. (Without it, this world hangs.)"""
    for result in run_world(_ddp_outlives_the_default_group, 2, timeout=60):
        assert result["after destroy"] == result["after ddp"] > 0
