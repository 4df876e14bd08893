"""The test harness itself (tests/distributed.py): what it promises the tests built on it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
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


def _first_attempt(marker: Path) -> bool:
    """True the first time this rank asks (each rank keeps its own marker file)."""
    if marker.exists():
        return False
    marker.touch()
    return True


def _gloo_fails_to_connect_once(rank, world, tmp: str, hang: bool):
    """Rank 0 fails as gloo does when a peer's connection drops while a group is made; at
    the first attempt only. With `hang`, rank 1 meanwhile waits, as ranks still
    connecting do."""
    if _first_attempt(Path(tmp) / f"rank{rank}"):
        if rank == 0:
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")
        if hang:
            time.sleep(12)
    return rank


@pytest.mark.parametrize("hang", [False, True])
def test_a_world_whose_gloo_connections_fail_is_started_once_more(tmp_path, hang):
    """A transport failure of the machine's loopback (once in CI: rank 0's connections
    closed by a peer, the other ranks waiting until the deadline) runs the world again;
    the second run's results are returned."""
    assert run_world(_gloo_fails_to_connect_once, 2, str(tmp_path), hang, timeout=6) == [0, 1]


def _fails_once(rank, world, tmp: str):
    if _first_attempt(Path(tmp) / f"rank{rank}") and rank == 0:
        raise ValueError("the code under test is wrong")
    return rank


def test_any_other_error_is_not_retried(tmp_path):
    with pytest.raises(RuntimeError, match="the code under test is wrong"):
        run_world(_fails_once, 2, str(tmp_path))
