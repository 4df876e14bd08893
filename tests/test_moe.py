"""Expert-parallel MoE layers, sharded by ZeRO over their expert-data-parallel groups:
the same training as one process holding every expert."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from training import global_batch, local_batch, make_optimizer, rel_l2
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.moe import MoE

WORLD, STEPS = 4, 6
MOE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, n_experts=4)


def moe_model(ep_size: int, cfg: GPTConfig = MOE) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(cfg, ep_size=ep_size))


def train_one_process(cfg: GPTConfig = MOE):
    """One process, every expert: each step averages the losses of the four ranks' local
    batches (what data parallelism optimises; the router's balancing loss and the
    capacity are per batch)."""
    model = moe_model(1, cfg)
    opt = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, 0, MOE)
        per = x.shape[0] // WORLD
        loss = sum(
            model(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for r in range(WORLD)
        )
        loss = loss / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    return train_one_process()


def _steps(engine: ZeroEngine, steps, rank: int, world: int) -> list[float]:
    """Train `steps`; each step's loss averaged over the ranks."""
    losses = []
    for step in steps:
        x, y = local_batch(step, 0, rank, world, MOE)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _train(rank: int, world: int, ep_size: int, stage: int, cfg: GPTConfig = MOE, **config):
    model = moe_model(ep_size, cfg)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **config))
    losses = _steps(engine, range(STEPS), rank, world)
    state = engine.full_state_dict()
    engine.close()
    return losses, state if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_expert_parallel_matches_one_process(ep_size, stage, reference):
    ref_losses, ref_state = reference
    losses, state = run_world(_train, WORLD, ep_size, stage)[0]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert state.keys() == ref_state.keys()
    assert rel_l2(state, ref_state) <= 1e-5


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple of ep_size=4"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="k=5 must be between 1 and num_experts=4"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=5)
    moe = MoE(8, torch.nn.Linear(8, 16), num_experts=2)
    with pytest.raises(ValueError, match="must return its input's shape"):
        moe(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="no expert-parallel group"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)(torch.randn(3, 8))


class _Skewed(torch.nn.Module):
    """An MoE layer whose router sends every token to expert 0."""

    def __init__(self, ep_size: int):
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=1)
        with torch.no_grad():
            self.moe.router.gate.weight.zero_()
            self.moe.router.gate.weight[0] = 1.0  # positive inputs: expert 0 always wins

    def forward(self, x):
        return self.moe(x)


def _skewed(rank: int, world: int, stage: int):
    """Rank r has 2r tokens (rank 0 none); every token goes to expert 0, so the other
    experts, and rank 0's whole batch, are empty: every collective must still pair up."""
    model = _Skewed(ep_size=world)
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
        ZeroConfig(stage=stage),
    )
    for step in range(3):
        x = torch.rand(2 * rank, 8, generator=torch.Generator().manual_seed(step)) + 0.1
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    engine.close()
    return state if rank == 0 else None


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_empty_experts_and_an_empty_rank_train_on(stage):
    state = run_world(_skewed, 2, stage, timeout=120)[0]
    assert all(torch.isfinite(v).all() for v in state.values())
    fresh = _Skewed(ep_size=1).state_dict()
    # Expert 0 trained (it saw every token); the others got zero gradients and stayed.
    moved = {n for n, v in state.items() if not torch.equal(v, fresh[n])}
    assert {n for n in moved if ".local." in n} == {
        "moe.experts.local.0.weight",
        "moe.experts.local.0.bias",
    }


def _resumable(rank, world, ep_size, stage, steps, ckpt, load, save, cfg=MOE):
    model = moe_model(ep_size, cfg)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    if load:
        engine.load_checkpoint(ckpt)
    losses = _steps(engine, steps, rank, world)
    if save:
        engine.save_checkpoint(ckpt)
    engine.close()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "loaded", "world"),
    [
        ((2, 2), (4, 3), WORLD),
        ((4, 3), (1, 1), WORLD),
        ((2, 1), (2, 3), WORLD),
        ((4, 2), (2, 3), 2),
        ((2, 0), (4, 3), WORLD),
    ],
)
def test_checkpoint_reloads_at_another_ep_size_and_stage(saved, loaded, world, tmp_path):
    """Experts are stored by global id: (ep_size, stage) -> another pair, at 4 ranks or
    at 2, continues as the uninterrupted 4-rank run. (The balancing loss is off: it is
    computed per rank's batch, so another world size changes the objective itself.)"""
    cfg = replace(MOE, moe_aux_loss_coef=0.0)
    ckpt = str(tmp_path / "ckpt")
    cut = STEPS // 2
    full = run_world(_resumable, WORLD, *saved, range(STEPS), ckpt, False, False, cfg)[0]
    run_world(_resumable, WORLD, *saved, range(cut), ckpt, False, True, cfg)
    index = json.loads(Path(ckpt, "index.json").read_text())
    experts = sorted(
        n
        for n in index["params"]
        if n.startswith("blocks.0.moe.experts.local.") and n.endswith(".0.weight")
    )
    assert experts == [f"blocks.0.moe.experts.local.{e}.0.weight" for e in range(4)]
    resumed = run_world(_resumable, world, *loaded, range(cut, STEPS), ckpt, True, False, cfg)[0]
    for got, want in zip(resumed, full[cut:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (resumed, full[cut:])


def test_consolidated_moe_checkpoint_loads_into_the_one_process_model(tmp_path):
    """`zero-strategy consolidate` of an ep_size-2 checkpoint: every expert, under its
    global id, in a plain state dict the ep_size-1 model loads."""
    from safetensors.torch import load_file

    from zero_strategy.cli import main

    ckpt = str(tmp_path / "ckpt")
    run_world(_resumable, 2, 2, 3, range(2), ckpt, False, True)
    out = tmp_path / "plain"
    assert main(["consolidate", ckpt, str(out)]) == 0
    state = load_file(str(out / "model.safetensors"))
    model = moe_model(1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte


def _memory(rank, world, ep_size, stage):
    model = moe_model(ep_size)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x, y = local_batch(0, 0, rank, world, MOE)
    engine.backward(engine(x, y))
    engine.step()
    report = engine.memory_report()
    engine.close()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_state_is_sharded_over_the_expert_data_parallel_group(stage):
    """ep_size 2 on 4 ranks: each rank holds 2 of the 4 experts, sharded over the 2 ranks
    holding the same ones, so its expert Adam moments are 1/4 of all experts' (8 bytes
    an element), as memory_report() shows; the planner's ep_size accounting agrees."""
    from zero_strategy.memory.planner import count_params, plan

    model = moe_model(1)
    every_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    for report in run_world(_memory, WORLD, 2, stage):
        # Beyond the moments: AdamW's 4-byte `step` per optimizer tensor (at most 2 param
        # groups x 2 layers) and the padding of each layer's expert unit to the group size.
        extra = report["expert_optimizer_state"] - every_expert * 8 / WORLD
        assert 0 < extra <= 4 * 2 * 2 + 8 * 2 * 1
        assert report["expert_parameters"] <= report["parameters"]
        params, root = count_params(model)
        predicted = plan(
            params, WORLD, stage, root_params=root, ep_size=2, expert_params=every_expert
        )
        state = sum(
            report[k] for k in ("parameters", "master_params", "gradients", "optimizer_state")
        )
        assert abs(predicted.model_state - state) <= 0.02 * state, (predicted.memory, report)


PYRAMID = replace(MOE, n_experts=[2, 4], moe_residual=True, moe_capacity_factor=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_pyramid_residual_capacity_model_matches_one_process(stage):
    """PR-MoE's shape: 2 then 4 experts, a dense MLP beside each, capacity 1.0 (tokens
    dropped), ep_size 2 on 4 ranks."""
    ref_losses, ref_state = train_one_process(PYRAMID)
    losses, state = run_world(_train, WORLD, 2, stage, PYRAMID)[0]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert state.keys() == ref_state.keys()
    assert rel_l2(state, ref_state) <= 1e-5


def test_capacity_drops_exactly_the_assignments_past_it():
    """8 tokens, top-1 over 2 experts, capacity ceil(8 / 2 * 0.75) = 3: of the six tokens
    routed to expert 0 the first three are kept and the next three dropped (output zero,
    so the block's residual stream carries them); expert 1's two tokens are kept."""
    torch.manual_seed(0)
    moe = MoE(
        8,
        torch.nn.Linear(8, 8),
        num_experts=2,
        k=1,
        capacity_factor=0.75,
        min_capacity=1,
        normalize=True,  # each kept token's weight is 1: its output is its expert's
    )
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0], moe.router.gate.weight[1, 0] = 1.0, -1.0
    x = torch.randn(8, 8)
    x[:, 0] = torch.tensor([1.0, 2, 3, 4, 5, 6, -1, -2])  # 6 tokens to expert 0, 2 to 1
    y = moe(x)
    experts = moe.experts.local
    for i in (0, 1, 2):
        torch.testing.assert_close(y[i], experts[0](x[i]))
    for i in (3, 4, 5):
        assert torch.equal(y[i], torch.zeros(8))
    for i in (6, 7):
        torch.testing.assert_close(y[i], experts[1](x[i]))
    moe.eval()  # eval_capacity_factor defaults to the training one
    assert torch.equal(moe(x)[3:6], torch.zeros(3, 8))


def test_random_token_selection_keeps_a_random_capacity_worth():
    torch.manual_seed(0)
    moe = MoE(
        8,
        torch.nn.Linear(8, 8),
        num_experts=2,
        k=1,
        capacity_factor=0.5,
        min_capacity=1,
        random_token_selection=True,
    )
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = 1.0
    x = torch.rand(16, 8) + 0.1  # every token prefers expert 0; capacity ceil(16/2*0.5) = 4
    kept = [frozenset(torch.nonzero(moe(x).abs().sum(1)).flatten().tolist()) for _ in range(4)]
    assert all(len(k) == 4 for k in kept)
    assert len(set(kept)) > 1  # not always the first four tokens
    with pytest.raises(ValueError, match="random_token_selection applies to top-1"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=2, k=2, random_token_selection=True)


def _built_on_meta(rank, world, stage, ep_size):
    from zero_strategy import init_on_meta

    torch.manual_seed(0)
    with init_on_meta():
        model = GPT(replace(MOE, ep_size=None))
    engine = ZeroEngine(
        model,
        make_optimizer(model),
        ZeroConfig(stage=stage, expert_parallel_size=ep_size),
    )
    state = engine.full_state_dict()
    engine.close()
    return state if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_meta_built_experts_get_their_global_values(stage):
    """Built on the meta device with ep_size=None: each rank materialises only its experts,
    with the values of their global ids (the same at expert_parallel_size 2 and 4), and
    no two experts alike (ranks do not repeat each other's initialisation)."""
    two = run_world(_built_on_meta, WORLD, stage, 2)[0]
    four = run_world(_built_on_meta, WORLD, stage, 4)[0]
    experts = sorted(n for n in two if ".experts." in n)
    assert len(experts) == 2 * 4 * 4  # 2 layers x 4 experts x (2 weights + 2 biases)
    for name in experts:
        assert torch.equal(two[name], four[name]), name
    first = [two[f"blocks.0.moe.experts.local.{e}.0.weight"] for e in range(4)]
    assert all(not torch.equal(first[a], first[b]) for a in range(4) for b in range(a))


def _pretrained_experts(rank, world, path):
    from zero_strategy import init_on_meta

    with init_on_meta():
        model = GPT(replace(MOE, ep_size=None))
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3, expert_parallel_size=2))
    read = engine.load_pretrained(path)["elements_read"]
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return read, state


def test_load_pretrained_gives_each_rank_its_experts_from_a_whole_model_file(tmp_path):
    """The one-process model's file (every expert under its global id): at
    expert_parallel_size 2 each rank reads its own experts and leaves the others' (not
    "unexpected"), and the model holds the file's values."""
    from safetensors.torch import save_file

    want = {k: v.detach().clone() for k, v in moe_model(1).state_dict().items()}
    del want["lm_head.weight"]  # tied to wte: safetensors stores it once
    save_file(want, str(tmp_path / "model.safetensors"))
    results = run_world(_pretrained_experts, 2, str(tmp_path))
    assert sum(read for read, _ in results) == sum(v.numel() for v in want.values())
    for _, state in results:
        for name, value in want.items():
            assert torch.equal(state[name], value), name


def _lightning_fit(rank, world, expert_parallel_size):
    import lightning as L
    from lightning_helpers import quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy

    class LitMoE(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(replace(MOE, ep_size=None))
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = local_batch(batch_idx, 0, self.global_rank, world, MOE)
            loss = self.model(x, y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.model)

    strategy = ZeroStrategy(stage=3, expert_parallel_size=expert_parallel_size)
    trainer = quiet_trainer(world, strategy, max_steps=4)
    module = LitMoE()
    data = torch.utils.data.DataLoader(torch.zeros(8 * world, 1), batch_size=1)
    trainer.fit(module, data)
    held = sum(1 for n, _ in module.model.named_parameters() if ".experts.local." in n)
    return module.losses, held


@pytest.mark.slow
def test_lightning_strategy_takes_the_expert_parallel_size():
    """Trainer(strategy=ZeroStrategy(stage=3, expert_parallel_size=2)) on 2 ranks splits
    the experts (each rank holds half) and trains as with every expert on every rank."""
    split = run_world(_lightning_fit, 2, 2)
    whole = run_world(_lightning_fit, 2, 1)
    for (losses, held), (want, held_all) in zip(split, whole, strict=True):
        assert held * 2 == held_all
        for got, ref in zip(losses, want, strict=True):
            assert abs(got - ref) <= 1e-5 * abs(ref)


def _settle(rank, world, ep_size, n_experts):
    model = GPT(replace(MOE, ep_size=None, n_experts=n_experts))
    ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=1, expert_parallel_size=ep_size))


def test_expert_parallel_size_that_divides_neither_world_nor_experts_is_refused():
    for ep_size, n_experts, needle in [
        (3, 6, "expert_parallel_size=3 does not divide the data-parallel world size 2"),
        (2, 3, "expert_parallel_size=2 does not divide this MoE layer's num_experts=3"),
    ]:
        for status, payload in run_world(_settle, 2, ep_size, n_experts, expect_errors=True):
            assert status == "error" and needle in payload, payload


def _fabric_fit(rank, world, expert_parallel_size):
    import os

    import lightning as L

    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    strategy = ZeroFabricStrategy(stage=2, expert_parallel_size=expert_parallel_size)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(replace(MOE, ep_size=None))
    model, optimizer = fabric.setup(model, make_optimizer(model))
    losses = []
    for step in range(4):
        x, y = local_batch(step, 0, rank, world, MOE)
        loss = model(x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_fabric_strategy_takes_the_expert_parallel_size():
    split = run_world(_fabric_fit, 2, 2)
    whole = run_world(_fabric_fit, 2, 1)
    for losses, want in zip(split, whole, strict=True):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want, strict=True))


BATCHED = replace(MOE, moe_batched=True)


@pytest.mark.slow
@pytest.mark.parametrize(("ep_size", "stage"), [(2, 1), (4, 3), (2, 3)])
def test_batched_experts_match_one_process(ep_size, stage):
    """Experts as batched [num_experts, ...] weights (BatchedMLP): each rank holds its rows."""
    ref_losses, ref_state = train_one_process(BATCHED)
    losses, state = run_world(_train, WORLD, ep_size, stage, BATCHED)[0]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert state.keys() == ref_state.keys()
    assert state["blocks.0.moe.experts.local.w_in"].shape == (4, 32, 128)
    assert rel_l2(state, ref_state) <= 1e-5


@pytest.mark.slow
def test_batched_expert_checkpoint_reloads_at_another_ep_size(tmp_path):
    """Each rank writes its rows of the [num_experts, ...] tensors; ep 2 -> 4 continues,
    and so does 2 ranks (balancing loss off, as for module experts)."""
    cfg = replace(BATCHED, moe_aux_loss_coef=0.0)
    ckpt = str(tmp_path / "ckpt")
    cut = STEPS // 2
    full = run_world(_resumable, WORLD, 2, 2, range(STEPS), ckpt, False, False, cfg)[0]
    run_world(_resumable, WORLD, 2, 2, range(cut), ckpt, False, True, cfg)
    index = json.loads(Path(ckpt, "index.json").read_text())
    assert index["params"]["blocks.0.moe.experts.local.w_in"]["shape"] == [4, 32, 128]
    resumed = run_world(_resumable, WORLD, 4, 3, range(cut, STEPS), ckpt, True, False, cfg)[0]
    for got, want in zip(resumed, full[cut:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    # And at another world size: 2 ranks, every expert split over both.
    resumed = run_world(_resumable, 2, 2, 1, range(cut, STEPS), ckpt, True, False, cfg)[0]
    for got, want in zip(resumed, full[cut:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


def _accelerate_fit(rank, world, expert_parallel_size):
    import os

    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    plugin = ZeroPlugin(stage=2, options={"expert_parallel_size": expert_parallel_size})
    accelerator = ZeroAccelerator(zero_plugin=plugin, cpu=True)
    torch.manual_seed(0)
    model = GPT(replace(MOE, ep_size=None))
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    losses = []
    for step in range(4):
        x, y = local_batch(step, 0, rank, world, MOE)
        loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    return losses, sorted(state)


@pytest.mark.slow
def test_accelerate_takes_the_expert_parallel_size():
    """ZeroAccelerator with expert_parallel_size=2 trains as with every expert on every
    rank, and get_state_dict consolidates every expert under its global id."""
    pytest.importorskip("accelerate")
    split = run_world(_accelerate_fit, 2, 2)
    whole = run_world(_accelerate_fit, 2, 1)
    (losses, names), (want, want_names) = split[0], whole[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want, strict=True))
    assert names == want_names


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_task_loss_trains_the_router_on_every_kernel_backend(backend):
    """The routing kernel picks the experts; the weights come from autograd-visible
    softmax, so the gate gets the task loss's gradient with the Triton kernel too (its
    outputs carry none), and the same weights as the reference."""
    import os

    from zero_strategy.kernels import use_backend

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run here under TRITON_INTERPRET=1")
    torch.manual_seed(0)
    moe = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2, aux_loss_coef=0.0)
    x = torch.randn(6, 8)
    with use_backend(backend):
        moe(x).pow(2).sum().backward()
    assert moe.router.gate.weight.grad is not None
    assert moe.router.gate.weight.grad.abs().sum() > 0
    with use_backend("reference"):
        want = moe.router(x).weights
    with use_backend(backend):
        got = moe.router(x).weights
    torch.testing.assert_close(got, want)


def test_placement_specs_are_checked_for_positions_and_copies():
    from zero_strategy import ShardSpec

    # Groups are sets: positions follow rank order, copies their first rank.
    assert ShardSpec(((3, 2), (1, 0))).groups == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="must rise from copy to copy"):
        ShardSpec(((0, 3), (1, 2))).check(4, "placement('x')")


def test_top1_routing_trains_the_router_from_the_task_loss():
    """Top-1 keeps the chosen expert's probability as its weight (Switch, DeepSpeed-MoE):
    renormalised it would be 1, and the task loss would never reach the router."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    norms = {}
    for normalize in (None, True):
        torch.manual_seed(1)
        moe = MoE(
            8, torch.nn.Linear(8, 8), num_experts=4, k=1, aux_loss_coef=0.0, normalize=normalize
        )
        moe(x).pow(2).sum().backward()
        norms[normalize] = moe.router.gate.weight.grad.norm().item()
    assert norms[None] > 1e-2
    assert norms[True] < 1e-5 * norms[None]  # p / p: rounding noise only
