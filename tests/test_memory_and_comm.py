"""memory_report() and comm_report() against the ZeRO formulas, exactly up to padding."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from training import local_batch, make_model, make_optimizer, train_zero
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
        # Only recycled memory: gloo's stages 2-3 reduce each parameter's own gradient
        # (no unit-sized buffer to keep), and stage 3 keeps one spare gather buffer per
        # unit size for the next gather.
        assert m["comm_buffers"] == 0  # nothing is being reduced
        spare_sizes = {u[1] for u in r["units"]} if stage == 3 else set()
        assert m["pooled"] == 4 * sum(spare_sizes)
        # The peak since the engine was built: at stage 3, the units gathered at once.
        assert m["peak_total"] >= m["total"]
        assert m["peak_gathered_parameters"] >= (4 * r["largest_unit"] if stage == 3 else 0)
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


@pytest.mark.parametrize("emulate", [False, True, None])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_volume_per_step(stage, emulate):
    """Stages 1-2 move one reduction of the gradients and one gather of the parameters;
    stage 3 gathers twice (forward and backward) except the root unit, kept from forward
    to backward. On gloo (None) a reduce-scatter is made of pairwise sends and counted as
    the reduce-scatter it is; asked for (True), it is an all-reduce."""
    r = run_world(
        _one_step, 2, stage, reduce_scatter_via_all_reduce=emulate, all_gather_via_broadcast=emulate
    )[0]
    comm = {k: v["bytes"] for k, v in r["comm"].items()}
    padded = sum(u[1] for u in r["units"])
    root = sum(u[1] for u in r["units"] if u[3])
    psi = r["psi"]
    reduce_kind = "all_reduce" if stage == 1 or emulate else "reduce_scatter"
    gather_kind = "all_gather" if emulate is False else "broadcast"
    # Whole units move padded; gloo's stages 2-3 reduce each parameter on its own (psi).
    assert 4 * psi <= comm[reduce_kind] <= 4 * padded
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


def _peaks(rank: int, world: int, prefetch_depth: int, emulate: bool = True):
    """One training step (which records the module order), then peaks over an evaluation
    forward alone, and over a training backward alone."""
    model = make_model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    config = ZeroConfig(
        stage=3, prefetch_depth=prefetch_depth, reduce_scatter_via_all_reduce=emulate
    )
    engine = ZeroEngine(model, make_optimizer(model), config)
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()
    engine.reset_memory_peaks()
    at_reset = engine.memory_report()
    with torch.no_grad():
        engine(x, y)
    after_eval = engine.memory_report()
    loss = engine(x, y)
    engine.reset_memory_peaks(record_timeline=True)
    engine.backward(loss)
    after_backward = engine.memory_report()
    timeline = engine.memory_timeline()
    units = [(u.layout.padded_numel, u.layout.module_path == "") for u in engine.units]
    # Elements of the trainable parameters inside this rank's shard (their pairwise sums).
    mine = 0
    for unit in engine.units:
        start, end = unit.layout.shard_range(unit.rank)
        for slot in unit.layout.slots:
            if slot.trainable:
                mine += max(0, min(slot.end, end) - max(slot.offset, start))
    return at_reset, after_eval, after_backward, timeline, units, psi, mine


@pytest.mark.parametrize("prefetch_depth", [0, 1])
def test_peaks_are_the_most_held_at_once(prefetch_depth):
    """Exact peaks: an evaluation forward holds the root unit (gathered first, released at
    the end) and, one block at a time, or two with prefetch (the next one's gather starts
    as a block begins); a training backward's gradients travel parameter by parameter
    (gloo) and, below the in-flight cap, all of them are in flight at once before the
    end of backward lands them."""
    at_reset, after_eval, after_backward, timeline, units, psi, _ = run_world(
        _peaks, 2, prefetch_depth
    )[0]
    root = next(n for n, is_root in units if is_root)
    block = max(n for n, is_root in units if not is_root)
    # Reset: the peaks are what is held now.
    assert all(at_reset[f"peak_{k}"] == at_reset[k] for k in ("total", "pooled", "gradients"))
    assert after_eval["gathered_parameters"] == 0
    blocks_at_once = 1 + prefetch_depth
    assert after_eval["peak_gathered_parameters"] == 4 * (root + blocks_at_once * block)
    assert after_eval["peak_total"] - after_eval["total"] <= 4 * (root + blocks_at_once * block)
    assert after_eval["peak_comm_buffers"] == 0
    # Backward: every gradient in flight at once, each element once (tied weights too).
    assert after_backward["comm_buffers"] == 0
    assert after_backward["peak_comm_buffers"] == 4 * psi
    # The timeline has every change, and its largest total is the peak.
    assert len(timeline) > 2 * len(units)
    assert max(held["total"] for _, held in timeline) == after_backward["peak_total"]
    times = [t for t, _ in timeline]
    assert times == sorted(times)
    # Samples read counters, not the tensors: the last one agrees with the ledger.
    in_memory = {k: v for k, v in after_backward.items() if not k.startswith(("peak", "disk"))}
    assert timeline[-1][1] == in_memory


def test_peaks_with_pairwise_sends():
    """gloo's default reduce-scatter sends each rank its part of every gradient: besides
    the gradients themselves, the peak holds exactly one receive buffer for each part of a
    gradient inside this rank's shard (two ranks: one peer)."""
    _, _, after_backward, timeline, _, psi, mine = run_world(_peaks, 2, 1, None)[0]
    assert after_backward["comm_buffers"] == 0
    assert after_backward["peak_comm_buffers"] == 4 * psi + 4 * mine
    in_memory = {k: v for k, v in after_backward.items() if not k.startswith(("peak", "disk"))}
    assert timeline[-1][1] == in_memory


def test_peaks_with_unit_buffers():
    """A real reduce-scatter fills a buffer per unit: the counters that samples read
    follow the buffers through filling, reduction and the pool, exactly."""
    _, _, after_backward, timeline, units, _, _ = run_world(_peaks, 2, 1, False)[0]
    largest = max(n for n, _ in units)
    assert after_backward["comm_buffers"] == 0
    assert 0 < after_backward["peak_comm_buffers"] <= 3 * 4 * largest
    in_memory = {k: v for k, v in after_backward.items() if not k.startswith(("peak", "disk"))}
    assert timeline[-1][1] == in_memory
    assert max(held["total"] for _, held in timeline) == after_backward["peak_total"]


def _two_paths(rank: int, world: int, stage: int, emulate: bool, use_no_sync: bool):
    return train_zero(
        rank,
        world,
        4,
        2,
        0.5,
        stage,
        use_no_sync=use_no_sync,
        reduce_scatter_via_all_reduce=emulate,
    )


@pytest.mark.parametrize("use_no_sync", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_parameter_by_parameter_reduction_equals_the_unit_buffers(stage, use_no_sync):
    """gloo's in-place paths (pairwise sends, or an all-reduce) send each parameter's
    gradient as autograd made it; a real reduce-scatter fills a unit buffer first (and
    no_sync's local sums always do). On 2 ranks all sum the same two numbers (a + b is
    b + a), so they train identically."""
    buffered = run_world(_two_paths, 2, stage, False, use_no_sync)[0]
    for emulate in (True, None):  # an all-reduce per parameter; pairwise sends per part
        direct = run_world(_two_paths, 2, stage, emulate, use_no_sync)[0]
        assert direct[0] == buffered[0]
        for name, value in buffered[1].items():
            assert torch.equal(direct[1][name], value), name


def _step_report(rank, world, stage, ranks_per_node):
    import os

    if ranks_per_node is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # as torchrun exports it
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    engine.reset_comm_report()
    for step in range(2):
        engine.backward(engine(*local_batch(step, 0, rank, world)))
        engine.step()
        engine.zero_grad()
    report = engine.comm_report()
    engine.close()
    return report


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_report_splits_what_a_rank_receives_by_node(stage):
    """With the launcher's LOCAL_WORLD_SIZE, each kind's bytes received from ranks of the
    same node and of other nodes: 2 ranks on one node receive everything within it, 2 on
    two nodes the same bytes across; a reduce-scatter or all-gather of B bytes brings B/2
    from the other rank, an all-reduce B (its two halves)."""
    one_node = run_world(_step_report, 2, stage, None)
    two_nodes = run_world(_step_report, 2, stage, 1)
    for same, apart in zip(one_node, two_nodes):
        assert same.keys() == apart.keys()
        for kind, counts in same.items():
            assert apart[kind]["bytes"] == counts["bytes"], kind
            assert counts["across_node_bytes"] == apart[kind]["within_node_bytes"] == 0, kind
            assert apart[kind]["across_node_bytes"] == counts["within_node_bytes"] > 0, kind
        for kind in ("reduce_scatter", "broadcast"):  # gloo's all-gather: broadcasts
            if kind in apart:
                assert apart[kind]["across_node_bytes"] == apart[kind]["bytes"] // 2, kind
        if "all_reduce" in apart:
            assert apart["all_reduce"]["across_node_bytes"] == apart["all_reduce"]["bytes"]
