"""Full parameters and gradients on demand, against DDP: `gathered_parameters()` (read,
and writes from one rank or from all), `full_grad()`, `keep_full_grads`, and world size 1
keeping everything in place."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_world
from tests.training import local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine


def _engine(stage: int, **config) -> ZeroEngine:
    model = make_model()
    return ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **config))


def _one_step(engine: ZeroEngine, rank: int, world: int) -> None:
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    engine.zero_grad()


def _gathered_read(rank, world, stage):
    engine = _engine(stage)
    _one_step(engine, rank, world)
    outside = [p.untyped_storage().nbytes() for p in engine.module.parameters()]
    with engine.gathered_parameters():
        inside = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = [p.untyped_storage().nbytes() for p in engine.module.parameters()]
    masters = engine.full_state_dict(rank0_only=False)
    engine.close()
    return outside, after, {n: torch.equal(v, masters[n]) for n, v in inside.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gathered_parameters_reads_the_full_trained_values(stage):
    for outside, after, same in run_world(_gathered_read, 2, stage):
        assert all(same.values()), [n for n, ok in same.items() if not ok]
        if stage == 3:  # freed before and after (one NaN element each): only the block holds them
            assert max(outside) == max(after) == 4
        else:
            assert min(outside) > 4


def _gathered_write(rank, world, stage, modifier_rank, compute_dtype, replace=False):
    """`replace`: each write assigns `p.data` anew (pruning made permanent, a lottery
    ticket) instead of writing in place."""
    engine = _engine(stage, compute_dtype=compute_dtype)
    _one_step(engine, rank, world)
    before = engine.full_state_dict(rank0_only=False)
    block = engine.module.blocks[1]
    with engine.gathered_parameters(block, modifier_rank=modifier_rank), torch.no_grad():
        for p in block.parameters():
            if modifier_rank is None:
                value = p.data * -2.0  # every rank writes the same values
            else:  # through .data, as Lightning's callbacks write; not the modifier's: discarded
                value = torch.full_like(p.data, 0.5 if rank == modifier_rank else -7.0)
            if replace:
                p.data = value
            else:
                p.data.copy_(value)
    after = engine.full_state_dict(rank0_only=False)
    # The next forward uses the written values on every rank.
    x, y = local_batch(1, 0, rank, world)
    with torch.no_grad():
        loss = engine(x, y).item()
    engine.close()
    return before, after, loss


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("modifier_rank", [1, None])
@pytest.mark.parametrize("replace", [False, True], ids=["in-place", "data-replaced"])
def test_gathered_parameters_writes_reach_the_masters(stage, modifier_rank, replace):
    results = run_world(_gathered_write, 2, stage, modifier_rank, "fp32", replace)
    (before, after, loss0), (_, after1, loss1) = results
    assert loss0 != loss1  # different batches, the same written model
    for name, value in before.items():
        assert torch.equal(after[name], after1[name])
        if name.startswith("blocks.1."):
            expected = torch.full_like(value, 0.5) if modifier_rank == 1 else value * -2.0
            assert torch.equal(after[name], expected), name
        else:
            assert torch.equal(after[name], value), name


def _read_only_bf16(rank, world, stage):
    engine = _engine(stage, compute_dtype="bf16")
    _one_step(engine, rank, world)
    before = engine.full_state_dict(rank0_only=False)
    with engine.gathered_parameters():
        total = sum(float(p.float().sum()) for p in engine.module.parameters())
    after = engine.full_state_dict(rank0_only=False)
    engine.close()
    return total, all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("stage", [2, 3])
def test_reading_in_bf16_never_rounds_the_fp32_masters(stage):
    (t0, same0), (t1, same1) = run_world(_read_only_bf16, 2, stage)
    assert same0 and same1
    assert t0 == t1


# ----------------------------------------------------------------- gradients
def _clipped_grads_ddp(rank, world, clip):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    x, y = local_batch(0, 0, rank, world)
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}


def _clipped_grads_zero(rank, world, stage, clip):
    engine = _engine(stage, keep_full_grads=True)
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.clip_grad_norm_(clip)
    shown = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    asked = {n: engine.full_grad(p) for n, p in engine.module.named_parameters()}
    per_module = engine.full_grads(engine.module.blocks[1])  # one gather per unit
    asked.update({f"blocks.1.{n}": g for n, g in per_module.items()})
    engine.step()
    engine.zero_grad()
    cleared = all(p.grad is None for p in engine.module.parameters())
    engine.close()
    return shown, asked, cleared


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_gradients_after_clipping_match_ddp(stage):
    clip = 0.05
    ddp = run_world(_clipped_grads_ddp, 2, clip)
    zero = run_world(_clipped_grads_zero, 2, stage, clip)
    for (shown, asked, cleared), reference in zip(zero, ddp):
        assert cleared
        assert shown.keys() == reference.keys()
        for name, ref in reference.items():
            torch.testing.assert_close(shown[name], ref, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(asked[name], ref, rtol=1e-5, atol=1e-7)


def _grad_lifecycle(rank, world, stage):
    """What a DDP user's loop reads of `.grad`: None before the first backward and after
    `zero_grad()`, zeros after `zero_grad(set_to_none=False)`, and the averaged gradient
    after a backward, also when `zero_grad()` came between the forward and the backward
    (Lightning's manual optimization) and when two backwards accumulate."""
    if stage is None:
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        optimizer = make_optimizer(model.module)
        params, forward = list(model.module.parameters()), model
        backward, zero_grad = torch.Tensor.backward, optimizer.zero_grad
    else:
        engine = _engine(stage)
        params, forward = list(engine.module.parameters()), engine
        backward, zero_grad = engine.backward, engine.zero_grad
    seen = {"before": [p.grad is None for p in params]}
    x, y = local_batch(0, 0, rank, world)
    backward(forward(x, y))
    seen["after_backward"] = [p.grad.clone() for p in params]
    zero_grad()
    seen["after_zero_grad"] = [p.grad is None for p in params]
    loss = forward(x, y)
    zero_grad()  # between the forward and its backward
    backward(loss)
    seen["zeroed_before_backward"] = [p.grad.clone() for p in params]
    x2, y2 = local_batch(0, 1, rank, world)
    backward(forward(x2, y2))  # accumulates onto the last one
    seen["accumulated"] = [p.grad.clone() for p in params]
    zero_grad(set_to_none=False)
    seen["zeros"] = [p.grad is not None and not p.grad.any() for p in params]
    if stage is not None:
        engine.close()
    return seen


@pytest.mark.parametrize("stage", [0, 1])
def test_grad_reads_as_a_ddp_models_through_zero_grad_at_stages_0_and_1(stage):
    ddp = run_world(_grad_lifecycle, 2, None)
    zero = run_world(_grad_lifecycle, 2, stage)
    for ours, reference in zip(zero, ddp):
        for key in ("before", "after_zero_grad", "zeros"):
            assert ours[key] == reference[key] == [True] * len(reference[key]), key
        for key in ("after_backward", "zeroed_before_backward", "accumulated"):
            for got, want in zip(ours[key], reference[key]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class _PartlyUsed(torch.nn.Module):
    """`unused` takes part in no forward; `rank0_only` in rank 0's alone (globally used);
    `early` in the first two steps only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.rank0_only = torch.nn.Linear(4, 4)
        self.early = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)
        self.step = 0

    def forward(self, x):
        h = self.body(x)
        if dist.get_rank() == 0:
            h = self.rank0_only(h)
        if self.step < 2:
            h = self.early(h)
        return h.square().mean()


def _unused_grads(rank, world, stage, keep_full_grads=False):
    model = _PartlyUsed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if stage is None:
        forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        step = optimizer.step
    else:
        config = ZeroConfig(stage=stage, keep_full_grads=keep_full_grads)
        forward = ZeroEngine(model, optimizer, config)
        step = forward.step
    names = [n for n, _ in model.named_parameters()]
    seen = []
    for i in range(3):
        model.step = i
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        forward(x).backward()
        seen.append({n: p.grad is None for n, p in zip(names, model.parameters())})
        step()
        to_none = i != 1  # zeros after the second step: `early` then steps with zeros
        optimizer.zero_grad(to_none) if stage is None else forward.zero_grad(to_none)
        seen.append({n: p.grad is None for n, p in zip(names, model.parameters())})
    if stage is not None:
        forward.wait_for_parameters()  # the last step's gathers (stages 1-2)
    weights = {n: p.detach().clone() for n, p in zip(names, model.parameters())}
    if stage is not None:
        forward.close()
    return seen, weights


@pytest.mark.parametrize(
    "stage, keep_full_grads", [(0, False), (1, False), (2, False), (3, False), (3, True)]
)
def test_a_parameter_no_rank_used_reads_none_after_backward_as_under_ddp(stage, keep_full_grads):
    """DDP (`find_unused_parameters=True`) leaves `.grad` None for a parameter no rank's
    forward used, and gives one used on some ranks only its averaged gradient everywhere;
    the optimizer then leaves the unused one as it is. After `zero_grad(set_to_none=False)`
    a parameter that had a gradient keeps its zeros through a backward that leaves it out,
    and Adam steps it with them (its momentum moves it); one that had none stays None.
    At stages 2-3 the same holds of the sharded faces, and of full gradients kept."""
    ddp = run_world(_unused_grads, 2, None)
    ours = run_world(_unused_grads, 2, stage, keep_full_grads)
    for (seen, weights), (ddp_seen, ddp_weights) in zip(ours, ddp):
        assert seen == ddp_seen
        assert all(seen[0][n] == n.startswith("unused.") for n in seen[0])
        assert not seen[4]["early.weight"] and seen[3]["unused.weight"]
        torch.testing.assert_close(weights, ddp_weights, rtol=1e-5, atol=1e-6)


class _TwoHeads(torch.nn.Module):
    """`shared` is stepped by both optimizers (its one `.grad` is theirs alike)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.shared = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.a(x) * self.b(x) + self.shared(x)).mean()


def _two_heads(stage, keep_full_grads=False):
    """`_TwoHeads`, an optimizer for `a` and one for `b` (both with `shared`), under DDP
    (`stage=None`) or the engine."""
    model = _TwoHeads()
    opt_a = torch.optim.AdamW([*model.a.parameters(), *model.shared.parameters()], lr=0.1)
    opt_b = torch.optim.AdamW([*model.b.parameters(), *model.shared.parameters()], lr=0.1)
    if stage is None:
        return model, opt_a, opt_b, torch.nn.parallel.DistributedDataParallel(model)
    config = ZeroConfig(stage=stage, keep_full_grads=keep_full_grads)
    return model, opt_a, opt_b, ZeroEngine(model, [opt_a, opt_b], config)


def _one_optimizers_zero_grad(rank, world, stage, keep_full_grads=False):
    model, opt_a, opt_b, forward = _two_heads(stage, keep_full_grads)
    steps = {id(opt_a): opt_a.step, id(opt_b): opt_b.step}
    if stage is not None:
        steps = {id(o): (lambda o=o: forward.step(o)) for o in (opt_a, opt_b)}
    seen = []
    for i, set_to_none in enumerate((True, False)):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        forward(x).backward()
        opt_a.zero_grad(set_to_none=set_to_none)  # (routed to the engine)
        seen.append(
            {
                n: None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()
            }
        )
        with torch.no_grad():  # a forward between leaves the gradients as they are
            forward(x)
        steps[id(opt_a)]()  # with zeros after the second: Adam's momentum moves it
        steps[id(opt_b)]()
        opt_b.zero_grad()
        opt_a.zero_grad()
    if stage is not None:
        forward.wait_for_parameters()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if stage is not None:
        forward.close()
    return seen, weights


@pytest.mark.parametrize(
    "stage, keep_full_grads", [(0, False), (1, False), (2, False), (3, False), (3, True)]
)
def test_one_optimizers_zero_grad_leaves_the_others_gradients_shown(stage, keep_full_grads):
    """Two optimizers (a GAN's, Lightning's manual optimization): one's `zero_grad()`
    takes its own parameters' `.grad` (to None, or to zeros its step then takes, as torch
    does, also after a forward between), and the other's still read their reduced
    gradients, equal to DDP's. A parameter both step loses its one `.grad` to either."""
    ddp = run_world(_one_optimizers_zero_grad, 2, None)
    ours = run_world(_one_optimizers_zero_grad, 2, stage, keep_full_grads)
    for (seen, weights), (ddp_seen, ddp_weights) in zip(ours, ddp):
        assert seen[0]["a.weight"] is None and seen[0]["b.weight"] is not None
        assert seen[0]["shared.weight"] is None
        assert torch.equal(seen[1]["a.weight"], torch.zeros(4, 4))
        assert torch.equal(seen[1]["shared.weight"], torch.zeros(4, 4))
        for got, want in zip(seen, ddp_seen):
            assert got.keys() == want.keys()
            for name in got:
                assert (got[name] is None) == (want[name] is None), name
                if want[name] is not None:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(weights, ddp_weights, rtol=1e-5, atol=1e-6)


class _BodyAndUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x).square().mean()


def _steps_without_gradients(rank, world, stage):
    model = _BodyAndUnused()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    if stage is None:
        forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        step, zero_grad = optimizer.step, optimizer.zero_grad
    else:
        forward = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
        step, zero_grad = forward.step, forward.zero_grad
    step()  # before any backward: nothing to step
    for i in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * i + rank))
        forward(x).backward()
        step()
        zero_grad(i != 1)  # to None; then to zeros, which `body` steps and `unused` has not
        step()  # no backward since: torch skips every parameter whose .grad is None
    if stage is not None:
        forward.wait_for_parameters()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if stage is not None:
        forward.close()
    return weights


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_with_no_gradient_since_zero_grad_changes_nothing(stage):
    """torch skips a parameter whose `.grad` is None: a step before any backward, or
    after `zero_grad()` with no backward since, applies no weight decay and leaves
    AdamW's step count (its bias correction) where it was. The engine skips such param
    groups whole. After `zero_grad(set_to_none=False)` the zeros are stepped, and a
    parameter no rank used (None under torch) is not."""
    ddp = run_world(_steps_without_gradients, 2, None)
    for weights, ddp_weights in zip(run_world(_steps_without_gradients, 2, stage), ddp):
        torch.testing.assert_close(weights, ddp_weights, rtol=1e-5, atol=1e-6)


def _grads_without_option(rank, world, stage):
    engine = _engine(stage)
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    shown = [type(p.grad).__name__ for p in engine.module.parameters()]
    engine.close()
    return shown


@pytest.mark.parametrize("stage", [2, 3])
def test_without_the_option_grad_is_the_sharded_face(stage):
    """The option is what costs DDP's gradient memory: off, .grad is a face over the
    shards (tests/test_grad_face.py), not a full-size tensor."""
    for shown in run_world(_grads_without_option, 2, stage):
        assert set(shown) == {"ShardedGrad"}


def test_full_grad_refuses_a_foreign_tensor():
    engine = _engine(3)
    with pytest.raises(ValueError, match="does not manage"):
        engine.full_grad(torch.zeros(3))


# ----------------------------------------------------------------- one process
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_one_keeps_parameters_and_gradients_in_place(stage):
    """Nothing to shard: the model reads and trains as in plain PyTorch, whatever stage."""
    assert not dist.is_initialized()
    reference = make_model()
    ref_opt = make_optimizer(reference)
    engine = _engine(stage)
    x, y = local_batch(0, 0, 0, 1)
    reference(x, y).backward()
    engine.backward(engine(x, y))
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        assert p.shape == q.shape, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    ref_opt.step()
    engine.step()
    for p, q in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _deep_copy(rank, world, stage):
    import copy

    engine = _engine(stage)
    _one_step(engine, rank, world)
    engine.wait_for_parameters()
    clone = copy.deepcopy(engine.module)  # an EMA copy, an averaged model
    engine.reset_comm_report()
    x, y = local_batch(1, 0, rank, world)
    with torch.no_grad():
        copied = clone(x, y).item()
    clone.zero_grad()  # the module's own, not the engine's
    quiet = engine.comm_report() == {}
    with torch.no_grad():
        original = engine(x, y).item()
    engine.close()
    return copied, original, quiet


@pytest.mark.parametrize("stage", [1, 2])
def test_a_deep_copy_of_the_model_is_a_plain_module(stage):
    for copied, original, quiet in run_world(_deep_copy, 2, stage):
        assert copied == original and quiet


def _accumulated_ddp(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    seen = []
    for micro in range(2):
        x, y = local_batch(0, micro, rank, world)
        with model.no_sync() if micro == 0 else contextlib.nullcontext():
            model(x, y).backward()
        seen.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
    return seen


def _accumulated_zero(rank, world, stage):
    engine = _engine(stage, keep_full_grads=True)
    seen = []
    for micro in range(2):
        x, y = local_batch(0, micro, rank, world)
        with engine.no_sync() if micro == 0 else contextlib.nullcontext():
            engine.backward(engine(x, y))
        seen.append({n: p.grad.clone() for n, p in engine.module.named_parameters()})
    engine.close()
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_kept_gradients_are_local_under_no_sync_and_reduced_after_as_ddp(stage):
    """DDP's .grad after a no_sync backward is each rank's own sum (they differ across
    ranks), and after the synchronised one the global mean: the same here."""
    ddp = run_world(_accumulated_ddp, 2)
    zero = run_world(_accumulated_zero, 2, stage)
    assert not torch.equal(ddp[0][0]["blocks.0.fc.weight"], ddp[1][0]["blocks.0.fc.weight"])
    for ours, reference in zip(zero, ddp):
        for got, want in zip(ours, reference):
            assert got.keys() == want.keys()
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7)


def _synchronised_inside_no_sync(rank, world, stage):
    """Accelerate's trigger_sync_in_backward: inside no_sync(), synchronised() makes the
    backward reduce; the gradients are then DDP's after its synchronising backward."""
    engine = _engine(stage, keep_full_grads=True)
    with engine.no_sync():
        engine.backward(engine(*local_batch(0, 0, rank, world)))
        with engine.synchronised():
            engine.backward(engine(*local_batch(0, 1, rank, world)))
    seen = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return seen


@pytest.mark.parametrize("stage", [1, 3])
def test_a_synchronised_backward_inside_no_sync_reduces_as_ddp(stage):
    ddp = run_world(_accumulated_ddp, 2)
    zero = run_world(_synchronised_inside_no_sync, 2, stage)
    for ours, reference in zip(zero, ddp):
        for name, value in reference[1].items():
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-7)


def _one_optimizers_zero_grad_in_no_sync(rank, world, stage):
    model, opt_a, _, forward = _two_heads(stage)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    with forward.no_sync():
        forward(x).backward()
        opt_a.zero_grad(set_to_none=False)
        seen = {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }
    if stage is not None:
        forward.close()
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_optimizers_zero_grad_in_no_sync_leaves_the_others_local_sums(stage):
    """Gradient accumulation with two optimizers: inside `no_sync()`, one's
    `zero_grad(set_to_none=False)` zeroes its parameters' `.grad`, and the other's still
    read this rank's own gradients, as under DDP (not the last reduced ones)."""
    ddp = run_world(_one_optimizers_zero_grad_in_no_sync, 2, None)
    for seen, ddp_seen in zip(run_world(_one_optimizers_zero_grad_in_no_sync, 2, stage), ddp):
        assert seen.keys() == ddp_seen.keys()
        for name, want in ddp_seen.items():
            assert (seen[name] is None) == (want is None), name
            if want is not None:
                torch.testing.assert_close(seen[name], want, rtol=1e-5, atol=1e-7)
