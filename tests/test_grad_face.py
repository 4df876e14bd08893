"""What user code reads between steps at stages 2-3: parameters with the model's own
shapes, and `.grad` over the shards (norms, dtype, clipping by hand, any read), equal to a
single process and to DDP, with no rank holding a whole-model gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_reference_world, run_world
from tests.training import global_batch, local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine

ORDERS = (2.0, 1.0, math.inf, 0.5)


def _norms(named, dtype=None) -> dict:
    out = {}
    for name, p in named:
        if p.grad is None:
            continue
        g = p.grad
        out[name] = [torch.linalg.vector_norm(g, o, dtype=dtype).item() for o in ORDERS]
        out[name].append(g.norm().item())
    grads = [p.grad for _, p in named if p.grad is not None]
    out["_foreach"] = [t.item() for t in torch._foreach_norm(grads, 2.0)]
    return out


def _reference_norms(compute_dtype: torch.dtype) -> dict:
    """One process, the global batch, the same precision through a world-1 engine at
    stage 0 (plain `.grad` in the compute dtype)."""
    model = make_model()
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=0, compute_dtype=compute_dtype)
    )
    x, y = global_batch(0, 0)
    engine.backward(engine(x, y))
    norms = _norms(list(engine.module.named_parameters()), dtype=torch.float32)
    dtypes = {n: p.grad.dtype for n, p in engine.module.named_parameters()}
    engine.close()
    return {"norms": norms, "dtypes": dtypes}


def _engine_norms(rank, world, stage, compute_dtype):
    model = make_model()
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=stage, compute_dtype=compute_dtype)
    )
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.reducer.wait()
    named = list(engine.module.named_parameters())
    engine.reset_comm_report()
    norms = _norms(named, dtype=torch.float32)
    control = engine.comm_report().get("control", {"calls": 0})["calls"]
    result = {
        "norms": norms,
        "control_calls": control,
        "dtypes": {n: p.grad.dtype for n, p in named},
        "read_bytes": engine.grad_reads.largest_read_bytes,
    }
    engine.close()
    return result


def _close(ours: dict, ref: dict, rtol: float) -> list[str]:
    bad = []
    for name, values in ref.items():
        for o, (a, b) in enumerate(zip(ours[name], values)):
            if abs(a - b) > rtol * max(abs(b), 1e-8):
                bad.append(f"{name}[{o}]: {a} vs {b}")
    return bad


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_norms_equal_one_process(stage, compute_dtype):
    dtype = getattr(torch, compute_dtype)
    ref = _reference_norms(dtype)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for result in run_world(_engine_norms, 2, stage, dtype):
        assert _close(result["norms"], ref["norms"], rtol) == []
        assert result["dtypes"] == ref["dtypes"]
        assert result["read_bytes"] == 0  # norms hold nothing full-size
        # one small all-reduce per order for every parameter (stages 2-3), none at 0-1
        assert result["control_calls"] == (len(ORDERS) if stage >= 2 else 0)


def _shapes(rank, world, stage):
    model = make_model()
    expected = {n: (p.shape, p.numel(), p.dtype, p.device) for n, p in model.named_parameters()}
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    shown = {
        n: (p.shape, p.numel(), p.dtype, p.device) for n, p in engine.module.named_parameters()
    }
    held = sum(p.untyped_storage().nbytes() for p in engine.module.parameters())
    tied = engine.module.lm_head.weight is engine.module.wte.weight
    engine.close()
    return expected, shown, held, tied


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_show_the_models_shapes_between_steps(stage):
    for expected, shown, held, tied in run_world(_shapes, 2, stage):
        assert shown == expected
        assert tied
        if stage == 3:  # freed: one shared element per unit, not the parameters' bytes
            assert held <= 4 * len(expected)


def _clipped_by_hand(rank, world, stage, how, steps=4, **config):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **config))
    for step in range(steps):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        params = engine.module.parameters()
        if how == "norm":
            torch.nn.utils.clip_grad_norm_(params, 0.05)
        elif how == "norm_foreach":
            torch.nn.utils.clip_grad_norm_(params, 0.05, foreach=True)
        elif how == "value":
            torch.nn.utils.clip_grad_value_(params, 1e-3)
        elif how == "index":  # a write through a view: the first embedding row frozen
            engine.module.wte.weight.grad[0] = 0.0
        elif how == "sync":
            _sync_by_hand(engine.module.parameters())
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict(rank0_only=False)
    read_bytes = engine.grad_reads.largest_read_bytes
    engine.close()
    return state, read_bytes


def _sync_by_hand(params) -> None:
    """Gradients synchronised again by hand, as some DDP code does (Lightning's manual
    optimization tests): summed over the ranks (twice the gradient, which DDP already
    averaged), a maximum and a broadcast of values every rank holds (no change)."""
    params = list(params)
    for p in params:
        dist.all_reduce(p.grad.data)
    dist.all_reduce(params[0].grad, op=dist.ReduceOp.MAX, async_op=True).wait()
    dist.broadcast(params[1].grad, src=1)


def _ddp_clipped(rank, world, how, steps=4):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(model.module)
    for step in range(steps):
        x, y = local_batch(step, 0, rank, world)
        model(x, y).backward()
        if how in ("norm", "norm_foreach"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif how == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        elif how == "index":
            model.module.wte.weight.grad[0] = 0.0
        elif how == "sync":
            _sync_by_hand(model.parameters())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.fixture(scope="module")
def ddp_weights():
    hows = ("norm", "value", "index", "sync", None)
    return {how: run_world(_ddp_clipped, 2, how)[0] for how in hows}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


@pytest.mark.parametrize("how", ["norm", "norm_foreach", "value", "index", "sync"])
@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_by_hand_gives_ddps_weights(stage, how, ddp_weights):
    ddp = ddp_weights["norm" if how == "norm_foreach" else how]
    for state, read_bytes in run_world(_clipped_by_hand, 2, stage, how):
        assert _max_diff(state, ddp) < 1e-5
        # the clip changed the training: DDP without it ends elsewhere
        assert _max_diff(state, ddp_weights[None]) > 1e-4
        if how != "index":
            assert read_bytes == 0  # clipping holds no full-size gradient
        else:  # one parameter's gradient, gathered for the write: the embedding's
            model = make_model()
            numel = model.wte.weight.numel()
            assert 0 < read_bytes <= 4 * (numel + 3 * numel)
            assert read_bytes < 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_offloaded_to_disk_are_read_and_clipped_as_in_memory(
    stage, tmp_path, ddp_weights
):
    """The disk tier brings each shard in for the read or the change (and writes it back
    after a change): the same weights as DDP."""
    from test_offload_grads import SMALL

    config = {"offload_optimizer": "disk", "offload_dir": str(tmp_path), **SMALL}
    for how in ("norm", "value"):
        for state, read_bytes in run_world(_clipped_by_hand, 2, stage, how, **config):
            assert _max_diff(state, ddp_weights[how]) < 1e-5
            assert read_bytes == 0


def _reads(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    w = engine.module.blocks[0].attn.qkv.weight
    out = {
        "clone": w.grad.clone(),
        "sum": w.grad.sum().item(),
        "row": w.grad[1].clone(),
        "view_item": w.grad.view(-1)[5].item(),
        "cpu_norm": torch.linalg.vector_norm(w.grad.detach().cpu(), 2, dtype=torch.float32),
        "equal_full_grad": torch.equal(w.grad, engine.full_grad(w).to(w.dtype)),
        "repr": repr(w.grad),
    }
    engine.close()
    return out


def test_any_read_of_a_gradient_gathers_it():
    model = make_model()
    x, y = global_batch(0, 0)
    model(x, y).backward()
    ref = model.blocks[0].attn.qkv.weight.grad
    for out in run_world(_reads, 2, 3):
        torch.testing.assert_close(out["clone"], ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["cpu_norm"], ref.norm(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out["row"], ref[1], rtol=1e-5, atol=1e-7)
        assert out["sum"] == pytest.approx(ref.sum().item(), rel=1e-4, abs=1e-6)
        assert out["view_item"] == pytest.approx(ref.view(-1)[5].item(), rel=1e-5, abs=1e-8)
        assert out["equal_full_grad"]
        assert "ShardedGrad" in out["repr"]


def _no_sync(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    with engine.no_sync():
        engine.backward(engine(x, y))
    local = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    engine.close()
    single = make_model()
    single(x, y).backward()
    return local, {n: p.grad for n, p in single.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_shows_the_local_sums_as_ddp_does(stage):
    for local, expected in run_world(_no_sync, 2, stage):
        for name, grad in expected.items():
            torch.testing.assert_close(local[name], grad, rtol=1e-5, atol=1e-7)


def _cleared_by_hand(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    for step in range(2):
        x, y = local_batch(step, 0, rank, world)
        engine.backward(engine(x, y))
        if step == 0:
            for p in engine.module.parameters():
                p.grad = None  # a zero_grad written by hand, bypassing the engine
    norm = engine.clip_grad_norm_(1e9)
    engine.close()
    return norm.item()


def test_setting_grad_to_none_by_hand_clears_the_shards():
    model = make_model()
    x, y = global_batch(1, 0)
    model(x, y).backward()
    only_second = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    for norm in run_world(_cleared_by_hand, 2, 3):
        assert norm == pytest.approx(only_second, rel=1e-5)


def _rank_local_write(rank, world):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    g = engine.module.wte.weight.grad
    try:
        torch.ones_like(engine.module.wte.weight).copy_(g)  # a read: fine
        other = torch.zeros(3)
        torch.add(other, 1, out=g[0, :3])  # writing into a face through out=: refused
    except RuntimeError as e:
        return str(e)
    finally:
        dist.barrier()
        engine.close()
    return "no error"


def test_writing_a_gradient_through_out_is_refused_with_the_way_out():
    for message in run_world(_rank_local_write, 2):
        assert "write into p.grad itself" in message


def _lightning_grad_norms(rank, world, strategy):
    import lightning as L
    from lightning.pytorch.utilities import grad_norm
    from lightning_helpers import lit_module_class, loader, quiet_trainer

    class Logged(lit_module_class()):
        def __init__(self):
            super().__init__()
            self.seen: list[dict[str, float]] = []

        def on_before_optimizer_step(self, optimizer):
            norms = grad_norm(self, norm_type=2)
            self.seen.append({k: v.item() for k, v in norms.items()})

    module = Logged()
    trainer = quiet_trainer(world, strategy, max_steps=3, num_sanity_val_steps=0)
    trainer.fit(module, loader(n_batches=3, world=world))
    assert L is not None
    return module.seen


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lightnings_grad_norm_equals_ddps(strategy):
    pytest.importorskip("lightning")
    ddp = run_reference_world(_lightning_grad_norms, 2, "ddp")[0]
    ours = run_world(_lightning_grad_norms, 2, strategy)
    assert len(ddp) == 3 and all(len(step) > 10 for step in ddp)
    for seen in ours:
        assert [sorted(s) for s in seen] == [sorted(s) for s in ddp]
        for got, want in zip(seen, ddp):
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _moe_shapes(rank, world):
    from test_moe import moe_model

    expected = {n: p.shape for n, p in moe_model(2).named_parameters()}
    model = moe_model(2)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    shown = {n: p.shape for n, p in engine.module.named_parameters()}
    engine.close()
    return expected, shown


def test_moe_experts_show_their_shapes_at_stage_3():
    for expected, shown in run_world(_moe_shapes, 2):
        assert shown == expected
        assert any("expert" in n for n in shown)


def _tensor_parallel(rank, world):
    from tensor_parallel_models import apply_llama_plan, batches, llama, loss_of
    from torch.distributed.device_mesh import init_device_mesh

    expected = {n: (p.shape, p.numel()) for n, p in llama().named_parameters()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = apply_llama_plan(llama(), mesh["tensor"])
    engine = ZeroEngine(
        model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3), device_mesh=mesh
    )
    shown = {n: (p.shape, p.numel()) for n, p in engine.module.named_parameters()}
    engine.backward(loss_of(engine.module, batches(1, 4)[0].chunk(2)[engine.rank]))
    norms = {
        n: torch.linalg.vector_norm(p.grad).full_tensor().item()
        if hasattr(p.grad, "full_tensor")
        else p.grad.norm().item()
        for n, p in engine.module.named_parameters()
    }
    engine.close()
    return expected, shown, norms


def test_tensor_parallel_parameters_show_global_shapes_and_norms():
    from tensor_parallel_models import batches, llama, loss_of

    model = llama()
    loss_of(model, batches(1, 4)[0]).backward()
    ref = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    for expected, shown, norms in run_world(_tensor_parallel, 4):
        assert shown == expected
        for name, value in ref.items():
            assert norms[name] == pytest.approx(value, rel=1e-4), name


def _kept_until_zero_grad(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    after_backward = [p.grad.norm().item() for p in engine.module.parameters()]
    with torch.no_grad():
        engine(x, y)  # an evaluation forward
    after_eval = [p.grad.norm().item() for p in engine.module.parameters()]
    engine.step()
    after_step = [p.grad.norm().item() for p in engine.module.parameters()]
    engine.zero_grad()
    after_zero = [p.grad for p in engine.module.parameters()]
    engine.close()
    return after_backward, after_eval, after_step, after_zero


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_stay_readable_until_zero_grad_as_under_ddp(stage):
    for backward, evaluated, stepped, zeroed in run_world(_kept_until_zero_grad, 2, stage):
        assert min(backward) > 0
        assert evaluated == backward
        assert stepped == backward
        assert zeroed == [None] * len(zeroed)


def _norms_follow_changes(rank, world, stage):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    params = list(engine.module.parameters())

    def total() -> float:
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()

    before = total()
    engine.clip_grad_norm_(before / 2)  # the engine's own clip
    after_engine_clip = total()
    torch.nn.utils.clip_grad_norm_(params, before / 4)  # a clip by hand
    after_hand_clip = total()
    params[0].grad.zero_()  # a write through one face
    first = params[0].grad.norm().item()
    engine.close()
    return before, after_engine_clip, after_hand_clip, first


@pytest.mark.parametrize("stage", [2, 3])
def test_norms_read_after_a_change_see_it(stage):
    for before, engine_clip, hand_clip, first in run_world(_norms_follow_changes, 2, stage):
        assert engine_clip == pytest.approx(before / 2, rel=1e-5)
        assert hand_clip == pytest.approx(before / 4, rel=1e-5)
        assert first == 0.0


def _bitwise_all_reduce(rank, world):
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=2))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    try:
        dist.all_reduce(engine.module.wte.weight.grad, op=dist.ReduceOp.BAND)
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_an_all_reduce_of_a_sharded_gradient_with_a_bitwise_op_is_refused_naming_the_ops():
    for message in run_world(_bitwise_all_reduce, 2):
        assert message and "SUM, AVG, MIN, MAX or PRODUCT" in message and "clone()" in message
