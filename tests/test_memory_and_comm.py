"""memory_report() and comm_report() against the ZeRO formulas, exactly up to padding."""

from __future__ import annotations

import pytest

from distributed import run_world
from training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine


def _one_step(rank: int, world: int, stage: int, **config):
    model = make_model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **config))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    comm = engine.comm_report()
    memory = engine.memory_report()
    n_opt_tensors = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    units = [
        (u.layout.numel, u.layout.padded_numel, u.layout.shard_numel, u.layout.module_path == "")
        for u in engine.units
    ]
    largest_unit = max(u.layout.padded_numel for u in engine.units)
    return dict(
        psi=psi,
        comm=comm,
        memory=memory,
        n_opt=n_opt_tensors,
        units=units,
        largest_unit=largest_unit,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_zero_formulas(stage, world):
    """fp32 AdamW: 4 (params) + 4 (grads) + 8 (Adam moments) bytes per parameter. Stage 1
    shards the 8, stage 2 also the 4 of gradients, stage 3 all 16 (ZeRO paper, Fig. 1)."""
    results = run_world(_one_step, world, stage)
    psi = results[0]["psi"]
    padded = sum(u[1] for u in results[0]["units"])
    shards = sum(u[2] for u in results[0]["units"])
    n = world
    for r in results:
        m = r["memory"]
        step_counters = 4 * r["n_opt"]  # AdamW's per-tensor fp32 `step`
        assert m["master_params"] == 0  # fp32: the master is the parameter shard itself
        assert m["gathered_parameters"] == 0  # nothing is left gathered after the step
        # Only recycled memory: at most three units' worth of gradient buffers (stages
        # 2-3) and, at stage 3, prefetch_depth + 1 spare gather buffers per unit size.
        recycled = {0: 0, 1: 0, 2: 3, 3: 3 + 2}[stage]
        assert m["comm_buffers"] <= recycled * 4 * r["largest_unit"]
        if stage == 0:
            assert m["parameters"] == 4 * psi and m["gradients"] == 4 * psi
            assert m["optimizer_state"] == 8 * psi + step_counters
        elif stage == 1:
            assert m["parameters"] == 4 * padded and m["gradients"] == 4 * padded
        elif stage == 2:
            assert m["parameters"] == 4 * padded and m["gradients"] == 4 * shards
        else:
            assert m["parameters"] == 4 * shards and m["gradients"] == 4 * shards
        # Against the formula itself: within the padding (< world elements per unit).
        formula = {
            0: 16 * psi,
            1: 8 * psi + 8 * psi / n,
            2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n,
        }[stage]
        model_state = m["parameters"] + m["gradients"] + m["optimizer_state"] - step_counters
        assert abs(model_state - formula) <= 16 * (padded - psi), (model_state, formula)
    if stage:
        # Adam moments: every trainable element is held by exactly one rank.
        total_moments = sum(r["memory"]["optimizer_state"] - 4 * r["n_opt"] for r in results)
        assert total_moments == 8 * psi


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_volume_per_step(stage, emulate):
    """Stages 1-2 move one reduction of the gradients and one gather of the parameters;
    stage 3 gathers twice (forward and backward) except the root unit, kept from forward
    to backward."""
    r = run_world(
        _one_step, 2, stage, reduce_scatter_via_all_reduce=emulate, all_gather_via_broadcast=emulate
    )[0]
    comm = {k: v["bytes"] for k, v in r["comm"].items()}
    padded = sum(u[1] for u in r["units"])
    root = sum(u[1] for u in r["units"] if u[3])
    psi = r["psi"]
    reduce_kind = "all_reduce" if stage == 1 or emulate else "reduce_scatter"
    gather_kind = "broadcast" if emulate else "all_gather"
    assert comm[reduce_kind] == 4 * padded
    expected_gather = 4 * padded if stage < 3 else 4 * (2 * padded - root)
    assert comm[gather_kind] == expected_gather
    assert {gather_kind, reduce_kind} <= set(comm) <= {gather_kind, reduce_kind, "control"}
    # Up to padding, the ZeRO paper's volumes: 2 psi (stages 1-2), 3 psi (stage 3) elements.
    paper = (2 if stage < 3 else 3) * 4 * psi
    assert comm[reduce_kind] + comm[gather_kind] <= paper + 12 * (padded - psi)
    if stage == 3:
        assert comm[reduce_kind] + comm[gather_kind] >= paper - 4 * root


def _accumulate(rank: int, world: int, stage: int):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    with engine.no_sync():
        engine.backward(engine(x, y))
    during = engine.comm_report()
    engine.backward(engine(x, y))
    after = engine.comm_report()
    return during, after


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_micro_batches_move_no_gradients(stage):
    during, after = run_world(_accumulate, 2, stage)[0]
    reduce_kinds = {"all_reduce", "reduce_scatter"}
    assert not reduce_kinds & set(during)
    assert reduce_kinds & set(after)


def _second_step(rank: int, world: int, max_reuse_distance: int):
    """Step 1 records the module order; return what step 2 gathers and holds."""
    model = make_model()
    config = ZeroConfig(stage=3, max_reuse_distance=max_reuse_distance)
    engine = ZeroEngine(model, make_optimizer(model), config)
    losses = []
    for step in range(3):
        x, y = local_batch(step, 0, rank, world)
        if step == 1:
            engine.reset_comm_report()
        loss = engine(x, y)
        if step == 1:
            held_after_forward = engine.memory_report()["gathered_parameters"]
        engine.backward(loss)
        engine.step()
        if step == 1:
            comm = engine.comm_report()
            held_after_step = engine.memory_report()["gathered_parameters"]
        losses.append(loss.item())
    units = [(u.layout.padded_numel, u.layout.module_path == "") for u in engine.units]
    return dict(
        losses=losses,
        gathered=comm["broadcast"]["bytes"],
        held_after_forward=held_after_forward,
        held_after_step=held_after_step,
        units=units,
    )


def test_reuse_distance_keeps_units_from_forward_into_backward():
    """max_reuse_distance=0 gathers every block twice per step; 1 keeps only the last block
    (backward needs it first); a distance above twice the model gathers each unit once.
    Training is bit-identical whichever is chosen."""
    by_distance = {d: run_world(_second_step, 2, d)[0] for d in (0, 1, 10**9)}
    units = by_distance[0]["units"]
    root = sum(n for n, is_root in units if is_root)
    blocks = [n for n, is_root in units if not is_root]
    padded = root + sum(blocks)
    assert len(blocks) >= 2
    expected = {0: 2 * padded - root, 1: 2 * padded - root - blocks[-1], 10**9: padded}
    for distance, r in by_distance.items():
        assert r["gathered"] == 4 * expected[distance], distance
        assert r["held_after_step"] == 0
        assert r["losses"] == by_distance[0]["losses"]
    assert by_distance[0]["held_after_forward"] == 4 * root
    assert by_distance[1]["held_after_forward"] == 4 * (root + blocks[-1])
    assert by_distance[10**9]["held_after_forward"] == 4 * padded
