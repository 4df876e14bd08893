"""The engine's process groups across a re-created default group: training goes on with
the same engine, a new engine can be built, and nothing hangs or leaks."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.distributed import run_world
from tests.training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine


def _train(engine: ZeroEngine, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = local_batch(step, 0, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _engine(stage: int) -> ZeroEngine:
    model = make_model()
    return ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))


def _across_reinit(rank, world, stage, rendezvous, recreate):
    engine = _engine(stage)
    losses = _train(engine, range(2), rank, world)
    if recreate:  # what Lightning's Fabric-vs-DDP parity script does between its runs
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    losses += _train(engine, range(2, 4), rank, world)  # the same engine goes on
    # ... on groups of the new world (a destroyed group is unknown to torch: it raises here;
    # on NCCL it would be shut down, on gloo it only goes on working by chance)
    for comm in engine.groups.communicators():
        if comm.distributed:
            assert dist.get_process_group_ranks(comm.group.group) == list(comm.group.ranks)
    fresh = _engine(stage)  # and a new one is built in the new world
    first = _train(fresh, range(1), rank, world)
    engine.close()
    fresh.close()
    return losses, first


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_follows_a_recreated_default_group(tmp_path, stage):
    rendezvous = os.path.join(tmp_path, "second")
    again = run_world(_across_reinit, 2, stage, rendezvous, True, timeout=120)
    straight = run_world(_across_reinit, 2, stage, rendezvous, False, timeout=120)
    assert again == straight


def _destroyed(rank, world):
    engine = _engine(3)
    _train(engine, range(1), rank, world)
    dist.destroy_process_group()
    try:
        _train(engine, range(1, 2), rank, world)
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    engine.close()  # local: nothing left to destroy
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['RENDEZVOUS']}", rank=rank, world_size=world
    )
    return message


def test_using_the_engine_without_a_default_group_names_the_fix(tmp_path):
    os.environ["RENDEZVOUS"] = os.path.join(tmp_path, "again")
    for message in run_world(_destroyed, 2):
        assert "default process group was destroyed" in message
        assert "init_process_group() again" in message
