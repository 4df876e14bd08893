"""Units on their own shard groups: a placement function shards one module over subgroups
(replicated across them) while the rest uses the whole world."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from training import (
    global_batch,
    local_batch,
    make_model,
    make_optimizer,
    rel_l2,
    train_ddp,
    train_reference,
    train_zero,
    train_zero_resumable,
)
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.layout.shard_spec import ShardSpec

STEPS, ACCUM, CLIP = 20, 2, 0.5
PAIRS = ShardSpec(((0, 1), (2, 3)))


def block_on_pairs(path: str, module: torch.nn.Module) -> ShardSpec | None:
    """The second transformer block is sharded over {0,1} and over {2,3}."""
    return PAIRS if path == "blocks.1" else None


def mlp_on_pairs(path: str, module: torch.nn.Module) -> ShardSpec | None:
    """The MLP inside the second block: at stage 3, units nested in the block's unit (the
    shape an MoE layer's experts take)."""
    return PAIRS if path in ("blocks.1.fc", "blocks.1.out") else None


def everything_on_pairs(path: str, module: torch.nn.Module) -> ShardSpec | None:
    """Hybrid sharding: the whole model sharded within pairs, replicated across them."""
    return PAIRS if path == "" else None


@pytest.fixture(scope="module")
def reference():
    return train_reference(STEPS, ACCUM, CLIP)


@pytest.fixture(scope="module")
def ddp_error(reference):
    _, state = run_world(train_ddp, 4, STEPS, ACCUM, CLIP)[0]
    return rel_l2(state, reference[1])


@pytest.mark.slow
@pytest.mark.parametrize("placement", [block_on_pairs, mlp_on_pairs, everything_on_pairs])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_subgroup_sharding_matches_single_process(stage, placement, reference, ddp_error):
    ref_losses, ref_state = reference
    losses, state = run_world(train_zero, 4, STEPS, ACCUM, CLIP, stage, placement=placement)[0]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])
    assert rel_l2(state, ref_state) <= max(1.5 * ddp_error, 5e-6)


def _first_step_report(rank: int, world: int, stage: int):
    model = make_model()
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=stage), placement=block_on_pairs
    )
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    norm = engine.clip_grad_norm_(1e9)  # measures, never clips
    engine.step()
    units = [
        {
            "path": u.layout.module_path,
            "numel": u.layout.numel,
            "groups": u.layout.spec.describe(),
            "group_size": u.group.size,
        }
        for u in engine.units
    ]
    n_opt = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    report = dict(memory=engine.memory_report(), units=units, n_opt=n_opt, norm=float(norm))
    engine.close()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_follows_each_group_size(stage):
    """fp32 AdamW: every unit's bytes follow its own group's size (2 for the placed block,
    4 for the rest), and the global norm counts each element once."""
    results = run_world(_first_step_report, 4, stage)
    units = results[0]["units"]
    if stage == 3:
        placed = [u for u in units if u["path"] == "blocks.1"]
        assert len(placed) == 1 and placed[0]["groups"] == [[0, 1], [2, 3]]
    for u in units:
        assert u["group_size"] == (2 if u["groups"] == [[0, 1], [2, 3]] else 4)
    assert any(u["group_size"] == 2 for u in units) and any(u["group_size"] == 4 for u in units)

    def padded(u) -> int:
        return math.ceil(u["numel"] / u["group_size"]) * u["group_size"]

    shard = sum(padded(u) // u["group_size"] for u in units)
    full = sum(padded(u) for u in units)
    for r in results:
        m = r["memory"]
        assert m["parameters"] == 4 * (shard if stage == 3 else full)
        assert m["gradients"] == 4 * (full if stage == 1 else shard)
        assert m["optimizer_state"] == 8 * shard + 4 * r["n_opt"]
        assert m["master_params"] == 0 and m["gathered_parameters"] == 0
    # Adam moments: the dense units once over the world, the placed block once per copy.
    moments = sum(r["memory"]["optimizer_state"] - 4 * r["n_opt"] for r in results)
    assert moments == 8 * sum(padded(u) * (4 // u["group_size"]) for u in units)
    # Every rank's gradient averaged over the world is the gradient of the global batch's
    # mean loss: its norm is single-process training's, each element counted once.
    want = _reference_norm_global()
    for r in results:
        assert abs(r["norm"] - want) <= 1e-5 * want


def _reference_norm_global() -> float:
    model = make_model()
    x, y = global_batch(0, 0)
    model(x, y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_from_subgroups_reloads_at_world_two(stage, tmp_path):
    total, cut = 8, 4
    ckpt = str(tmp_path / "ckpt")
    full_losses, full_state, _ = run_world(
        train_zero_resumable,
        4,
        stage,
        range(total),
        ckpt,
        False,
        False,
        placement=block_on_pairs,
    )[0]
    run_world(
        train_zero_resumable, 4, stage, range(cut), ckpt, False, True, placement=block_on_pairs
    )
    index = json.loads(Path(ckpt, "index.json").read_text())
    groups = {tuple(map(tuple, u["shard_groups"])) for u in index["units"]}
    assert ((0, 1), (2, 3)) in groups and ((0, 1, 2, 3),) in groups
    # Each element written once: the placed block by the first copy's ranks only.
    for name, entry in index["params"].items():
        covered = sum(p["end"] - p["start"] for p in entry["pieces"])
        assert covered == math.prod(entry["shape"]), name
        if name.startswith("blocks.1."):
            assert {p["rank"] for p in entry["pieces"]} <= {0, 1}, name
    losses, state, _ = run_world(
        train_zero_resumable, 2, stage, range(cut, total), ckpt, True, False, seed=1
    )[0]
    for got, want in zip(losses, full_losses[cut:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert rel_l2(state, full_state) < 1e-5


# ------------------------------------------------------------------------ lifecycle
def _live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _build_and_drop(rank: int, world: int, stage: int):
    before = _live_groups()
    for _ in range(4):
        model = make_model()
        engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
        x, y = local_batch(0, 0, rank, world)
        engine.backward(engine(x, y))
        engine.step()
        del model, engine
    gc.collect()
    after_drop = _live_groups()
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    alive = _live_groups()
    engine.close()
    after_close = _live_groups()
    return before, after_drop, alive, after_close


@pytest.mark.parametrize("stage", [0, 3])
def test_engines_destroy_their_groups(stage):
    """Four engines built, stepped and dropped leave no process group behind (it was 4
    groups more before); close() destroys a live engine's groups at once."""
    for before, after_drop, alive, after_close in run_world(_build_and_drop, 2, stage):
        assert after_drop == before
        # The engine's world group, and at stage 3 the module-order check's.
        assert alive == before + (2 if stage == 3 else 1)
        assert after_close == before


def _train(rank: int, world: int, close_at: int | None):
    """Four stage-3 steps; close() before step `close_at` (the next forward re-opens)."""
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    live = _live_groups()
    losses, reopened = [], None
    for step in range(4):
        if step == close_at:
            engine.close()
            # Its world group and its module-order check's.
            closed = engine.closed and _live_groups() == live - 2
        x, y = local_batch(step, 0, rank, world)
        loss = engine(x, y)
        if step == close_at:
            reopened = closed and not engine.closed and _live_groups() == live
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.close()
    return losses, reopened


def test_a_closed_engine_reopens_at_its_next_collective():
    """close() between steps, as a framework teardown does: training goes on exactly as
    uninterrupted, the groups re-created by the next forward."""
    interrupted = run_world(_train, 2, 2)
    uninterrupted = run_world(_train, 2, None)
    for (losses, reopened), (want, _) in zip(interrupted, uninterrupted, strict=True):
        assert reopened
        assert losses == want


# ------------------------------------------------------------------------ bad input
def _build(rank: int, world: int, placement, stage: int = 3):
    model = make_model()
    ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage), placement=placement)


def _uneven(path, module):
    return ShardSpec(((0,), (1, 2, 3))) if path == "blocks.0" else None


def _not_a_spec(path, module):
    return [[0, 1], [2, 3]] if path == "blocks.0" else None


def _per_rank(path, module):
    return ShardSpec.contiguous(4, 2 if dist.get_rank() else 4) if path == "blocks.0" else None


def _splits_tied_weight(path, module):
    return PAIRS if path == "wte" else None


def _distinct(path, module):
    return ShardSpec(PAIRS.groups, replicated=False) if path == "blocks.0" else None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "stage", "needle"),
    [
        (_uneven, 3, "ShardSpec.contiguous"),
        (_not_a_spec, 3, "return a ShardSpec"),
        (_per_rank, 3, "same placement"),
        (_splits_tied_weight, 2, "shared by modules placed on different shard groups"),
        (_distinct, 3, "Return a replicated ShardSpec"),
    ],
)
def test_bad_placement_is_refused_on_every_rank(placement, stage, needle):
    results = run_world(_build, 4, placement, stage, expect_errors=True)
    for status, payload in results:
        assert status == "error" and needle in payload, payload


def test_contiguous_spec_needs_a_divisor():
    assert ShardSpec.contiguous(4, 2) == PAIRS
    assert PAIRS.replica_groups() == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match="use a divisor of 6"):
        ShardSpec.contiguous(6, 4)
