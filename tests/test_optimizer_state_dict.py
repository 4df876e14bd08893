"""`optimizer.state_dict()` / `load_state_dict()` on an optimizer the engine shards: each
rank's state dict is its own shards, marked; it loads back into the same rank, and a load
of another rank's or of a whole (DDP) state dict is refused, naming the checkpoint that
loads it, which the test then follows."""

from __future__ import annotations

import io

import pytest
import torch

from tests.distributed import run_world
from training import global_batch, local_batch, make_model, make_optimizer

STEPS = 2


def _plain_run():
    model = make_model()
    opt = make_optimizer(model)
    for step in range(STEPS):
        model(*global_batch(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict()


def _round_trips(rank, world, stage, folder):
    import torch.distributed as dist

    from zero_strategy import ZeroConfig, ZeroEngine

    model = make_model()
    optimizer = make_optimizer(model)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    for step in range(STEPS):
        engine.backward(engine(*local_batch(step, 0, rank, world)))
        engine.step()
        engine.zero_grad()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # each rank its own
    own = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    before = engine.full_optimizer_state_dict()
    optimizer.load_state_dict(own)  # its own shards: taken
    after = engine.full_optimizer_state_dict()
    shards = [None, None]
    dist.all_gather_object(shards, buffer.getvalue())
    errors = {}
    try:
        optimizer.load_state_dict(torch.load(io.BytesIO(shards[1 - rank]), weights_only=True))
    except ValueError as e:
        errors["other_rank"] = str(e)
    model_state, whole = _plain_run()
    try:
        optimizer.load_state_dict(whole)
    except ValueError as e:
        errors["whole"] = str(e)
    # What the message names: one file with the whole state, loaded by the engine.
    path = f"{folder}/whole.pt"
    if rank == 0:
        torch.save({"state_dict": model_state, "optimizer_states": [whole]}, path)
    dist.barrier()
    engine.load_checkpoint(path)
    loaded = engine.full_optimizer_state_dict()
    engine.close()
    return before, after, errors, loaded, whole


@pytest.mark.parametrize("stage", [1, 3])
def test_each_rank_loads_its_own_and_another_ranks_or_a_whole_one_is_refused(stage, tmp_path):
    results = run_world(_round_trips, 2, stage, str(tmp_path))
    (before, after, errors, loaded, whole), (_, _, errors1, _, _) = results
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    for found in (errors, errors1):
        assert "rank" in found["other_rank"] and "engine.save_checkpoint()" in found["other_rank"]
        assert "without zero-strategy's mark" in found["whole"]
        assert "engine.load_checkpoint()" in found["whole"]
    assert "rank 1 of 2" in errors["other_rank"] and "this is rank 0 of 2" in errors["other_rank"]
    assert loaded["param_groups"] == whole["param_groups"]
    torch.testing.assert_close(loaded["state"], whole["state"], rtol=0, atol=0)
