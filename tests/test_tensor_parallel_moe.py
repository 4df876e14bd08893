"""Tensor parallelism with MoE layers (dp 2 x tp 2 = 4 gloo ranks): attention (and the
dense and shared-expert MLPs) split over the tensor dimension by the model's own plan,
the routed experts whole at every tensor position and split over the data-parallel
ranks by expert parallelism, ZeRO over the data dimension. Trains as one process
holding every expert does; checkpoints change all three sizes."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine

pytest.importorskip("transformers")
from test_hf_moe import PER_RANK, SEQ, global_batches
from test_hf_moe import build as build_moe

STEPS, LR, CLIP = 4, 1e-2, 0.3


def build(arch: str) -> torch.nn.Module:
    """test_hf_moe's tiny model with 4 attention heads and 2 key/value heads (split 2 + 2
    and 1 + 1 over two tensor positions); DeepSeek-V3 with a dense first layer beside
    its MoE layer, shared experts beside the routed ones: both in its plan."""
    dense_first = {"first_k_dense_replace": 1} if arch == "deepseek_v3" else {}
    return build_moe(arch, num_attention_heads=4, num_key_value_heads=2, **dense_first)


def apply_model_plan(model: torch.nn.Module, tensor_mesh) -> torch.nn.Module:
    """The column- and row-wise entries of the model's own plan
    (`config.base_model_tp_plan`) applied with torch's `parallelize_module`. Routed
    experts are in no entry: they stay whole."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {
        pattern: styles[style]()
        for pattern, style in model.config.base_model_tp_plan.items()
        if style in styles and pattern.startswith("layers.")
    }
    prefix = "layers.*."
    for layer in model.model.layers:  # each layer's own: a dense layer, or an MoE one
        names = {n for n, _ in layer.named_modules()}
        here = {p[len(prefix) :]: s for p, s in plan.items() if p[len(prefix) :] in names}
        parallelize_module(layer, tensor_mesh, here)
    return model


def batches(dp: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Each step's batch, `PER_RANK` samples a data-parallel rank."""
    return global_batches(dp, steps)


def one_process(arch: str, dp: int = 2, steps: int = STEPS):
    """Every expert in one process, each step's batch split as the data-parallel ranks
    split it (the auxiliary loss is per rank's tokens); clipped as the engine clips."""
    model = build(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches(dp, steps):
        parts = [model(input_ids=x, labels=x).loss for x in batch.split(PER_RANK)]
        loss = sum(parts) / dp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(arch: str, dp: int, tp: int, ep: int, stage: int, **options):
    from torch.distributed.device_mesh import init_device_mesh

    model, mesh = build(arch), None
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
        apply_model_plan(model, mesh["tensor"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, expert_parallel_size=ep, gradient_clipping=CLIP, **options)
    return ZeroEngine(model, optimizer, config, device_mesh=mesh)


def _language_model_loss(engine: ZeroEngine, ids: torch.Tensor) -> torch.Tensor:
    return engine.module(input_ids=ids, labels=ids).loss


def _train(engine: ZeroEngine, data, loss_of=_language_model_loss) -> list[float]:
    """Each data-parallel rank trains on its part of every batch of `data`; the whole
    batch's loss is the mean of every rank's (the tensor positions of one data rank
    repeat theirs)."""
    losses = []
    for batch in data:
        loss = loss_of(engine, batch.split(PER_RANK)[engine.rank])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / torch.distributed.get_world_size())
    return losses


def _run(rank, world, arch, tp, ep, stage, steps, load=None, save=None, **options):
    dp = world // tp
    engine = _engine(arch, dp, tp, ep, stage, **options)
    experts = {
        n: m.num_experts for n, m in engine.module.named_modules() if n.endswith("mlp.experts")
    }
    split = {n for n, p in engine.module.named_parameters() if type(p).__name__ == "DTensor"}
    if load:
        engine.load_checkpoint(load)
    losses = _train(engine, [batches(dp)[step] for step in steps])
    if save:
        engine.save_checkpoint(save)
    on_disk = engine.memory_report()["disk_total"]
    engine.close()
    return losses, experts, split, on_disk


def _close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert got == pytest.approx(want, rel=rel), (got, want)


@pytest.mark.parametrize(
    ("arch", "ep", "stage"),
    [("mixtral", 2, 3), ("mixtral", 1, 1), ("deepseek_v3", 2, 2), ("deepseek_v3", 1, 3)],
)
def test_tensor_and_expert_parallel_moe_trains_as_one_process(arch, ep, stage):
    """With clipping (the norm spans tensor shards, expert copies and ZeRO shards): every
    rank's losses are one process's within 1e-5; each rank holds 4 / ep experts of each
    layer, and the plan split attention and the dense MLPs, not the routed experts."""
    want, _ = one_process(arch)
    for losses, experts, split, _ in run_world(_run, 4, arch, 2, ep, stage, range(STEPS)):
        _close(losses, want)
        assert experts and set(experts.values()) == {4 // ep}
        assert "model.layers.1.self_attn.o_proj.weight" in split
        assert not any(".experts." in name for name in split)
        if arch == "deepseek_v3":
            assert {
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.1.mlp.shared_experts.down_proj.weight",
            } <= split


@pytest.mark.parametrize("tier", ["optimizer", "optimizer and parameters"])
def test_disk_offload_beside_tensor_and_expert_parallelism_trains_as_one_process(tier, tmp_path):
    """The optimizer state (and at stage 3 the parameter shards) in files, at dp 2 x tp 2
    with 2 experts a data rank: one process's losses."""
    options = {"offload_optimizer": "disk", "offload_dir": str(tmp_path)}
    if tier == "optimizer and parameters":
        options["offload_params"] = "disk"
    want, _ = one_process("mixtral")
    for losses, _, _, on_disk in run_world(_run, 4, "mixtral", 2, 2, 3, range(STEPS), **options):
        _close(losses, want)
        assert on_disk > 0


def test_checkpoint_changes_tensor_expert_and_data_sizes(tmp_path):
    """Saved at (dp 2, tp 2, ep 2) stage 3 halfway: resumed at (dp 2, tp 1, ep 1) stage 1
    and at (dp 2, tp 2, ep 1) stage 2, each continues as the run that never stopped; the
    consolidated checkpoint holds one process's weights at the break."""
    from zero_strategy.checkpoint.consolidate import iter_tensors

    path = tmp_path / "ck"
    half = STEPS // 2
    full = run_world(_run, 4, "mixtral", 2, 2, 3, range(STEPS))[0][0]
    run_world(_run, 4, "mixtral", 2, 2, 3, range(half), save=str(path))
    for world, tp, ep, stage in [(2, 1, 1, 1), (4, 2, 1, 2)]:
        resumed = run_world(_run, world, "mixtral", tp, ep, stage, range(half, STEPS), str(path))
        for losses, *_ in resumed:
            _close(losses, full[half:], rel=1e-6)
    _, weights = one_process("mixtral", steps=half)
    consolidated = dict(iter_tensors(path))
    assert set(consolidated) == set(weights)
    for name, value in weights.items():
        torch.testing.assert_close(consolidated[name], value, rtol=1e-4, atol=LR * 1e-2)


# ---------------------------------------------------------------------------- zero_strategy.moe.MoE
D = 16


class _DenseThenMoE(torch.nn.Module):
    """A dense MLP (split column- then row-wise) and an MoE layer of the project's own,
    each behind a norm and a residual."""

    def __init__(self, ep_size: int | None):
        super().__init__()
        from zero_strategy.moe import MoE

        torch.manual_seed(0)
        self.norm, self.up, self.down = (
            torch.nn.LayerNorm(D),
            torch.nn.Linear(D, 4 * D),
            torch.nn.Linear(4 * D, D),
        )
        expert = torch.nn.Sequential(
            torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D)
        )
        self.moe_norm = torch.nn.LayerNorm(D)
        self.moe = MoE(D, expert, num_experts=4, ep_size=ep_size, k=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        x = x + self.moe(self.moe_norm(x))
        loss = x.square().mean()
        return loss + self.moe.last_losses if self.training else loss


def _dense_then_moe_data(dp: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(dp * PER_RANK, SEQ, D, generator=g) for _ in range(STEPS)]


def _own_moe(rank, world, stage, ep, split_experts, save):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dp, tp = world // 2, 2
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
    model = _DenseThenMoE(ep_size=None)  # the engine's expert_parallel_size decides
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if split_experts:  # each expert's MLP split as the dense one (expert tensor parallelism)
        for index in range(len(model.moe.experts.local)):
            plan[f"moe.experts.local.{index}.0"] = ColwiseParallel()
            plan[f"moe.experts.local.{index}.2"] = RowwiseParallel()
    parallelize_module(model, mesh["tensor"], plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, expert_parallel_size=ep, gradient_clipping=CLIP)
    engine = ZeroEngine(model, optimizer, config, device_mesh=mesh)
    losses = _train(engine, _dense_then_moe_data(dp), lambda engine, x: engine(x))
    engine.save_checkpoint(save)
    held = model.moe.num_local
    engine.close()
    return losses, held


@pytest.mark.parametrize(
    ("stage", "split_experts"), [(1, False), (3, False), (3, True)], ids=["1", "3", "3-ETP"]
)
def test_the_projects_own_moe_layer_beside_tensor_parallelism_trains_as_one_process(
    stage, split_experts, tmp_path
):
    """Experts whole at both tensor positions, or each expert split column- then
    row-wise as the dense MLP is: with 2 of the 4 experts on each data-parallel rank, the
    losses are one process's, and the consolidated checkpoint holds its weights."""
    from zero_strategy.checkpoint.consolidate import iter_tensors

    model = _DenseThenMoE(ep_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    want = []
    for batch in _dense_then_moe_data(2):
        loss = sum(model(x) for x in batch.split(PER_RANK)) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    path = tmp_path / "ck"
    for losses, held in run_world(_own_moe, 4, stage, 2, split_experts, str(path)):
        _close(losses, want)
        assert held == 2
    consolidated = dict(iter_tensors(path))
    reloaded = run_world(_own_moe_reloaded, 2, str(path))  # dp 2, no tensor parallelism
    assert set(consolidated) == set(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(consolidated[name], value, rtol=1e-4, atol=LR * 1e-2)
        for state in reloaded:
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=LR * 1e-2)


def _own_moe_reloaded(rank, world, path):
    model = _DenseThenMoE(ep_size=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, expert_parallel_size=2))
    engine.load_checkpoint(path)
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return state


def _batched_experts_split(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zero_strategy.moe import MoE
    from zero_strategy.moe.batched import BatchedMLP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = torch.nn.Sequential(MoE(D, BatchedMLP(D, 2 * D), num_experts=4, ep_size=None))
    experts = model[0].experts.local
    experts.w_in = torch.nn.Parameter(
        distribute_tensor(experts.w_in.data, mesh["tensor"], [Shard(2)])
    )
    try:
        config = ZeroConfig(stage=3, expert_parallel_size=2)
        ZeroEngine(model, torch.optim.AdamW(model.parameters()), config, device_mesh=mesh)
    except ValueError as e:
        return str(e)
    return None


def test_batched_experts_split_by_tensor_parallelism_are_refused_by_expert_parallelism():
    for message in run_world(_batched_experts_split, 4):
        assert message is not None
        for words in (
            "0.experts.local.w_in",
            "split by tensor parallelism",
            "expert_parallel_size=1",
        ):
            assert words in message, message


# ---------------------------------------------------------------------------- Lightning
def _lightning_fit(rank, world, tp, real_init):
    from lightning_helpers import parallelized_module, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.lightning import ZeroStrategy

    def parallelize(model, device_mesh):
        if tp > 1:
            apply_model_plan(model, device_mesh["tensor_parallel"])

    strategy = ZeroStrategy(stage=3, tensor_parallel_size=tp, expert_parallel_size=2)
    trainer = quiet_trainer(world, strategy, max_steps=STEPS, gradient_clip_val=CLIP)
    module = parallelized_module(
        lambda: build("mixtral"),
        parallelize,
        lambda model, ids: model(input_ids=ids, labels=ids).loss,
        LR,
        real_init,
    )
    data = torch.cat(batches(2))  # each data-parallel rank: its part of each batch
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=PER_RANK))
    experts = module.model.model.layers[0].mlp.experts.num_experts
    return module.losses, experts


@pytest.mark.parametrize("real_init", [True, False], ids=["built", "on-meta"])
def test_lightning_trains_an_moe_model_with_a_plan_and_expert_parallelism(real_init):
    """Trainer(strategy=ZeroStrategy(stage=3, tensor_parallel_size=2,
    expert_parallel_size=2), devices=4): the same losses as the model without the plan
    on 2 ranks (built for real, or on the meta device and initialised by the engine)."""
    with_plan = run_world(_lightning_fit, 4, 2, real_init)
    without = run_world(_lightning_fit, 2, 1, real_init)
    for rank, (losses, experts) in enumerate(with_plan):
        _close(losses, without[rank // 2][0])
        assert experts == 2


# ---------------------------------------------------------------------------- planner
def _model_state(rank, world, stage, ep, dtype):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = build("mixtral")
    apply_model_plan(model, mesh["tensor"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, expert_parallel_size=ep, compute_dtype=dtype)
    engine = ZeroEngine(model, optimizer, config, device_mesh=mesh)
    _train(engine, batches(2, 1))
    m = engine.memory_report()
    engine.close()
    return m["parameters"] + m["master_params"] + m["gradients"] + m["optimizer_state"]


@pytest.mark.parametrize(("stage", "ep", "dtype"), [(1, 2, "fp32"), (3, 2, "bf16"), (2, 1, "fp32")])
def test_planner_accounts_for_tensor_and_expert_parallelism_within_2_percent(stage, ep, dtype):
    """The plan's split (attention) and the experts (whole at each position, over ep of
    the data-parallel ranks), as the planner counts them from the model."""
    from zero_strategy.memory.planner import (
        count_params,
        expert_params,
        plan,
        tensor_shardable_params,
    )

    model = build("mixtral")
    params, root = count_params(model)
    predicted = plan(
        params,
        4,
        stage,
        dtype,
        root_params=root,
        ep_size=ep,
        expert_params=expert_params(model),
        tensor_parallel_size=2,
        tensor_sharded_params=tensor_shardable_params(model),
    )
    for state in run_world(_model_state, 4, stage, ep, dtype):
        assert abs(predicted.model_state - state) <= 0.02 * state, (predicted.memory, state)


def test_estimate_cli_counts_the_experts_of_a_config(tmp_path, capsys):
    """`zero-strategy estimate --hf-config` takes the experts' count from the model (no
    --expert-params needed) and refuses an ep_size the data-parallel ranks cannot hold."""
    import json

    from zero_strategy.cli import main
    from zero_strategy.memory.planner import (
        count_params,
        expert_params,
        plan,
        tensor_shardable_params,
    )

    model = build("mixtral")
    model.config.save_pretrained(tmp_path)
    args = ["estimate", "--hf-config", str(tmp_path / "config.json"), "--world-size", "4"]
    args += ["--stage", "1", "--dtype", "fp32", "--tensor-parallel", "2"]
    experts = expert_params(model)
    assert experts == 2 * 4 * 3 * 16 * 24  # 2 layers of 4 experts: gate, up and down
    params, root = count_params(model)
    sharded = tensor_shardable_params(model)
    for ep in (1, 2):
        assert main([*args, "--ep-size", str(ep), "--json"]) == 0
        (one,) = json.loads(capsys.readouterr().out)
        want = plan(
            params,
            4,
            1,
            "fp32",
            root_params=root,
            ep_size=ep,
            expert_params=experts,
            tensor_parallel_size=2,
            tensor_sharded_params=sharded,
        )
        assert one["memory"] == want.memory
    # Stage 1 holds every parameter it runs: ep 2 halves the experts there.
    halved = plan(
        params,
        4,
        1,
        "fp32",
        root_params=root,
        ep_size=2,
        expert_params=experts,
        tensor_parallel_size=2,
        tensor_sharded_params=sharded,
    ).memory["parameters"]
    whole = plan(
        params,
        4,
        1,
        "fp32",
        root_params=root,
        tensor_parallel_size=2,
        tensor_sharded_params=sharded,
    ).memory["parameters"]
    assert whole - halved == 4 * experts / 2
    assert main([*args, "--ep-size", "4"]) == 1
    err = capsys.readouterr().err
    assert "ep_size=4 is invalid: it must divide the 2 data-parallel ranks" in err


# ---------------------------------------------------------------------------- Fabric, Accelerate
def _door_fit(rank, world, door):
    """A few clipped steps through Fabric or Accelerate, each told both sizes."""
    import os

    if door == "fabric":
        import lightning as L

        from zero_strategy.integrations.fabric import ZeroFabricStrategy

        strategy = ZeroFabricStrategy(
            stage=3,
            tensor_parallel_size=2,
            expert_parallel_size=2,
            parallelize_fn=lambda model, mesh: apply_model_plan(model, mesh["tensor_parallel"]),
        )
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()  # ranks already exist (as under torchrun): this only sets up
        model = fabric.setup(build("mixtral"))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        backward = fabric.backward
        clip = lambda: fabric.clip_gradients(model, optimizer, max_norm=CLIP)  # noqa: E731
    else:
        from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        options = {"tensor_parallel_size": 2, "expert_parallel_size": 2}
        accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3, options=options))
        model = apply_model_plan(build("mixtral"), accelerator.device_mesh["tp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
        clip = lambda: accelerator.clip_grad_norm_(model.parameters(), CLIP)  # noqa: E731
    losses = []
    for batch in batches(2):
        x = batch.split(PER_RANK)[rank // 2]  # the data-parallel index
        loss = model(input_ids=x, labels=x).loss
        backward(loss)
        clip()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


@pytest.mark.parametrize("door", ["fabric", "accelerate"])
def test_fabric_and_accelerate_take_tensor_and_expert_parallel_sizes(door):
    """Fabric (parallelize_fn) and Accelerate (the plan on accelerator.device_mesh["tp"]),
    each told both sizes, with clipping: one process's losses."""
    want, _ = one_process("mixtral")
    for losses in run_world(_door_fit, 4, door):
        _close(losses, want)


# ---------------------------------------------------------------------------- whole model
def _split_model(which: str, mesh) -> torch.nn.Module:
    """Mixtral under its plan (experts whole at each position), or the project's MoE with
    each expert split as a dense MLP."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if which == "mixtral":
        return apply_model_plan(build("mixtral"), mesh["tensor"])
    model = _DenseThenMoE(ep_size=None)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for index in range(len(model.moe.experts.local)):
        plan[f"moe.experts.local.{index}.0"] = ColwiseParallel()
        plan[f"moe.experts.local.{index}.2"] = RowwiseParallel()
    return parallelize_module(model, mesh["tensor"], plan)


def _whole_views(rank, world, which, pretrained):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = _split_model(which, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=3, expert_parallel_size=2)
    engine = ZeroEngine(model, optimizer, config, device_mesh=mesh)
    if pretrained:  # the same weights as built: zeros first, so that a block not read shows
        with engine.gathered_parameters(modifier_rank=0):
            for p in model.parameters():
                p.detach().zero_()
        engine.load_pretrained(pretrained)
    everywhere, rank0 = engine.full_state_dict(rank0_only=False), engine.full_state_dict()
    engine.close()
    return everywhere, rank0


@pytest.mark.parametrize("which", ["mixtral", "split experts"])
@pytest.mark.parametrize("pretrained", [False, True], ids=["built", "load_pretrained"])
def test_whole_model_views_hold_every_expert_under_its_global_name(which, pretrained, tmp_path):
    """At dp 2 x tp 2 with 2 experts a data rank: `full_state_dict()` (on every rank, or
    rank 0's) assembles each expert's blocks under its global name, equal to the model
    one process builds; `load_pretrained` of that model's file gives each position its
    block of each of its experts."""
    from safetensors.torch import save_file

    whole = build("mixtral") if which == "mixtral" else _DenseThenMoE(ep_size=1)
    want = {k: v.detach().clone().contiguous() for k, v in whole.state_dict().items()}
    path = None
    if pretrained:
        path = str(tmp_path / "model.safetensors")
        save_file(want, path)
    for rank, (everywhere, rank0) in enumerate(run_world(_whole_views, 4, which, path)):
        for state in (everywhere, rank0) if rank == 0 else (everywhere,):
            assert set(state) == set(want)
            for name, value in want.items():
                assert torch.equal(state[name], value), name
        if rank:
            assert rank0 == {}


def _too_many_expert_ranks(rank, world):
    try:
        _engine("mixtral", 2, 2, 4, 3)  # 4 ranks, but 2 data-parallel ones
    except ValueError as e:
        return str(e)
    return None


def test_an_expert_parallel_size_above_the_data_parallel_ranks_is_refused():
    """Experts are split over the data-parallel ranks: ep 4 on dp 2 x tp 2 is refused,
    naming the data-parallel world, not the 4 ranks."""
    for message in run_world(_too_many_expert_ranks, 4):
        assert message is not None
        assert "expert_parallel_size=4 does not divide the data-parallel world size 2" in message
