"""ZeRO beside torch's tensor parallelism on a (data x tensor) mesh: a Hugging Face Llama
with the standard plan trains as one process does, its checkpoints change both sizes, and
bad meshes are refused (4 gloo ranks: dp 2 x tp 2)."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import preload, run_world, warm_the_compiler
from zero_strategy import ZeroConfig, ZeroEngine

pytest.importorskip("transformers")
from tensor_parallel_models import apply_llama_plan, batches, llama, loss_of

warm_the_compiler()  # the Accelerate door compiles in its ranks
preload("transformers.models.llama.modeling_llama", "zero_strategy.integrations.accelerate")

STEPS, BATCH, CLIP, LR = 4, 4, 0.5, 1e-2
# Weights after AdamW steps, against one process: Adam divides each update by the
# gradient's own scale, so an element whose gradient is near zero moves by a fraction of
# LR that rounding decides (tensor parallelism splits the matmuls, and the sums round
# differently, more or less on another CPU). 1% of one step's LR is rounding; a missed
# update or a misplaced block is LR or more, on many elements.
WEIGHTS_ATOL = LR * 1e-2


def _engine(dp: int, tp: int, stage: int, dtype: str = "fp32"):
    from torch.distributed.device_mesh import init_device_mesh

    model, mesh = llama(), None
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
        apply_llama_plan(model, mesh["tensor"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, gradient_clipping=CLIP, compute_dtype=dtype)
    engine = ZeroEngine(model, optimizer, config, device_mesh=mesh)
    return engine, engine.rank  # the data-parallel index: which part of the batch


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The whole batch's loss: the mean of every rank's (tensor ranks repeat theirs)."""
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


def _llama_loss(engine: ZeroEngine, ids: torch.Tensor) -> torch.Tensor:
    return loss_of(engine.module, ids)


def _train(engine: ZeroEngine, data_index: int, dp: int, data, loss_fn=_llama_loss) -> list[float]:
    """Each data-parallel rank trains on its part of every batch; returns the losses of
    the whole batches (the mean of the parts)."""
    losses = []
    for batch in data:
        loss = loss_fn(engine, batch.chunk(dp)[data_index])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses


def _single_process(
    steps: int, model: torch.nn.Module | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = llama() if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches(steps, BATCH):
        loss = loss_of(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


def _train_and_save(rank, world, stage, path):
    engine, d = _engine(2, 2, stage)
    data = batches(STEPS, BATCH)
    losses = _train(engine, d, 2, data[: STEPS // 2])
    engine.save_checkpoint(path)
    losses += _train(engine, d, 2, data[STEPS // 2 :])
    engine.close()
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dp2_tp2_llama_matches_one_process(stage, tmp_path):
    """Stages 1 and 3 over the data dimension, with clipping (the norm spans shards of
    both dimensions): the losses are one process's within 1e-5, and the checkpoint,
    consolidated to a plain model, holds one process's weights."""
    from zero_strategy.checkpoint.consolidate import iter_tensors

    path = tmp_path / "ck"
    ref_losses, _ = _single_process(STEPS)
    _, ref_weights = _single_process(STEPS // 2)
    losses = run_world(_train_and_save, 4, stage, str(path))
    for rank_losses in losses:
        _close(rank_losses, ref_losses)
    consolidated = dict(iter_tensors(path))
    assert set(consolidated) == set(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(consolidated[name], value, rtol=1e-4, atol=WEIGHTS_ATOL)
    index = json.loads((path / "index.json").read_text())
    q = index["params"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [32, 32]
    assert q["tensor_parallel"] == {
        "placements": ["Shard(0)"],
        "blocks": [[[0, 0], [16, 32]], [[16, 0], [16, 32]]],
    }
    assert "tensor_parallel" not in index["params"]["model.norm.weight"]
    assert index["world_size"] == 4


def _resume(rank, world, path, dp, tp, stage):
    engine, d = _engine(dp, tp, stage)
    engine.load_checkpoint(path)
    losses = _train(engine, d, dp, batches(STEPS, BATCH)[STEPS // 2 :])
    engine.close()
    return losses


def test_checkpoint_changes_data_and_tensor_sizes(tmp_path):
    """Saved at (dp 2, tp 2) stage 3; resumed at (4, 1) and at (1, 2), and at (2, 2)
    stage 1: each continues as the run that never stopped."""
    path = tmp_path / "ck"
    uninterrupted = run_world(_train_and_save, 4, 3, str(path))[0][STEPS // 2 :]
    for dp, tp, stage in [(4, 1, 3), (1, 2, 3), (2, 2, 1)]:
        resumed = run_world(_resume, dp * tp, str(path), dp, tp, stage)
        for rank_losses in resumed:
            _close(rank_losses, uninterrupted, rel=1e-6)


# ---------------------------------------------------------------------------- bad input
def _bad(rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh

    model = llama()
    if case == "no mesh":
        apply_llama_plan(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tensor",)))
        kwargs, config = {}, ZeroConfig(stage=3)
    elif case == "size":
        kwargs, config = {}, ZeroConfig(stage=3, tensor_parallel_size=3)
    elif case == "1-D mesh":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor",))
        kwargs, config = {"device_mesh": mesh}, ZeroConfig(stage=3)
    elif case == "heads":  # one key/value head: the plan would split it over two ranks
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data", "tensor"))
        model = apply_llama_plan(llama(kv_heads=1), mesh["tensor"])
        kwargs, config = {"device_mesh": mesh}, ZeroConfig(stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        ZeroEngine(model, optimizer, config, **kwargs)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case, words",
    [
        ("no mesh", ["is a DTensor", "device_mesh", "tensor_parallel_size=2"]),
        ("size", ["tensor_parallel_size=3", "does not divide the world size 2", "[1, 2]"]),
        ("1-D mesh", ["2-D mesh", "init_device_mesh"]),
        ("heads", ["num_key_value_heads=1", "tensor_parallel_size=2", "divides"]),
    ],
)
def test_bad_meshes_are_refused_naming_the_fix(case, words):
    for message in run_world(_bad, 2, case):
        assert message is not None
        for word in words:
            assert word in message, message


# ---------------------------------------------------------------------------- Lightning
def _lightning_fit(rank, world, which, real_init=True, tp=2):
    import lightning as L
    from lightning_helpers import parallelized_module, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.lightning import ZeroStrategy

    def parallelize(model, device_mesh):
        """The plan on the mesh's "tensor_parallel" dimension (and, for
        ModelParallelStrategy, FSDP2 over "data_parallel")."""
        if tp > 1:
            apply_llama_plan(model, device_mesh["tensor_parallel"])
        if which == "model_parallel":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=device_mesh["data_parallel"])
            fully_shard(model, mesh=device_mesh["data_parallel"])

    if which == "zero":
        strategy = ZeroStrategy(stage=3, tensor_parallel_size=tp)
    else:
        strategy = L.pytorch.strategies.ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=2
        )
    data = torch.cat(batches(STEPS, BATCH))  # each data-parallel rank: half of each batch
    trainer = quiet_trainer(world, strategy, max_steps=STEPS, gradient_clip_val=None)
    module = parallelized_module(llama, parallelize, loss_of, LR, real_init)
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=BATCH // 2))
    return module.losses


def test_lightning_tensor_parallel_matches_model_parallel_strategy():
    """Trainer(strategy=ZeroStrategy(stage=3, tensor_parallel_size=2), devices=4) with the
    configure_model a ModelParallelStrategy user writes: the same losses as that
    strategy (FSDP2 + tensor parallel) on the same model and data."""
    ours = run_world(_lightning_fit, 4, "zero")
    theirs = run_world(_lightning_fit, 4, "model_parallel")
    for mine, reference in zip(ours, theirs):
        _close(mine, reference)


def test_lightning_configure_model_on_meta_with_a_plan():
    """configure_model() builds the Hugging Face model on the meta device (inside the
    LightningModule) and applies the plan there: the engine initialises it with the
    model's own _init_weights, each rank keeping its block, so it trains as the same
    model built on meta without tensor parallelism (2 ranks, the same data split)."""
    with_plan = run_world(_lightning_fit, 4, "zero", False, 2)
    without = run_world(_lightning_fit, 2, "zero", False, 1)
    for rank, losses in enumerate(with_plan):
        _close(losses, without[rank // 2])


# ---------------------------------------------------------------------------- Fabric, Accelerate
def _fabric_fit(rank, world):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    def parallelize(model, device_mesh):
        return apply_llama_plan(model, device_mesh["tensor_parallel"])

    strategy = ZeroFabricStrategy(stage=3, tensor_parallel_size=2, parallelize_fn=parallelize)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # ranks already exist (as under torchrun): this only sets up
    model = fabric.setup(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    data = torch.cat(batches(STEPS, BATCH))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(data), batch_size=BATCH // 2))
    losses = []
    for (ids,) in loader:
        loss = loss_of(model, ids)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses


def _accelerate_fit(rank, world, dynamo_backend=None, layers=2):
    import os
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    os.environ["ZERO_STRATEGY_TENSOR_PARALLEL_SIZE"] = "2"
    compile_with = {"dynamo_backend": dynamo_backend} if dynamo_backend else {}
    accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3), **compile_with)
    model = apply_llama_plan(llama(layers=layers), accelerator.device_mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = torch.cat(batches(STEPS, BATCH))
    loader = DataLoader(TensorDataset(data), batch_size=BATCH // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    warned = [str(w.message) for w in caught if "tensor parallelism" in str(w.message)]
    assert not warned, warned
    losses = []
    for (ids,) in loader:
        loss = loss_of(model, ids)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    accelerator.end_training()
    if dynamo_backend:  # it ran compiled
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    return losses


@pytest.mark.parametrize("door", ["fabric", "accelerate", "accelerate-dynamo"])
def test_fabric_and_accelerate_take_the_same_spelling(door):
    """Fabric (parallelize_fn, as its ModelParallelStrategy) and Accelerate (the plan on
    accelerator.device_mesh["tp"], the size from ZERO_STRATEGY_TENSOR_PARALLEL_SIZE): the
    losses of one process, with clipping; with Accelerate's dynamo_backend too, compiled
    (each DTensor shard on a storage of its own: `FlatUnit.point_param_at`)."""
    pytest.importorskip("lightning" if door == "fabric" else "accelerate")
    fit = _fabric_fit if door == "fabric" else _accelerate_fit
    # Compiled: aot_eager (inductor: minutes), on one decoder layer (the DTensor shards
    # under the compiler, as in test_compile's runs; a second layer is a third more tracing).
    extra = ("aot_eager", 1) if door == "accelerate-dynamo" else ()
    reference, _ = _single_process(STEPS, llama(layers=extra[1]) if extra else None)
    for losses in run_world(fit, 4, *extra):
        _close(losses, reference)


# ---------------------------------------------------------------------------- planner
def _model_state(rank, world, stage, dtype):
    engine, d = _engine(2, 2, stage, dtype)
    _train(engine, d, 2, batches(1, BATCH))
    m = engine.memory_report()
    engine.close()
    return m["parameters"] + m["master_params"] + m["gradients"] + m["optimizer_state"]


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_planner_accounts_for_tensor_parallelism_within_2_percent(stage, dtype):
    from zero_strategy.memory.planner import count_params, plan, tensor_shardable_params

    model = llama()
    params, root = count_params(model)
    predicted = plan(
        params,
        4,
        stage,
        dtype,
        root_params=root,
        tensor_parallel_size=2,
        tensor_sharded_params=tensor_shardable_params(model),
    )
    for state in run_world(_model_state, 4, stage, dtype):
        assert abs(predicted.model_state - state) <= 0.02 * state, (predicted.memory, state)


def test_estimate_cli_takes_tensor_parallel(capsys):
    from zero_strategy.cli import main

    args = ["estimate", "--params", "8M", "--world-size", "4", "--stage", "3", "--dtype", "fp32"]
    assert main([*args, "--tensor-parallel", "2", "--json"]) == 0
    (one,) = json.loads(capsys.readouterr().out)
    assert one["world_size"] == 4
    assert one["memory"]["parameters"] == 4 * 8e6 / 2 / 2  # fp32, over tp 2 then dp 2
    assert main([*args, "--tensor-parallel", "3"]) == 1
    assert (
        "tensor_parallel_size=3 is invalid: it must divide world_size=4: use one of [1, 2, 4]"
        in (capsys.readouterr().err)
    )


# ---------------------------------------------------------------------------- whole model
def _whole_model_views(rank, world, stage, pretrained):
    engine, d = _engine(2, 2, stage)
    read = None
    if pretrained:
        read = engine.load_pretrained(pretrained)["elements_read"]
    else:
        _train(engine, d, 2, batches(STEPS // 2, BATCH))
    state = engine.full_state_dict()
    engine.close()
    return state, read


@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dict_and_pretrained_weights_are_whole_tensors(stage, tmp_path):
    """full_state_dict() assembles each tensor-parallel parameter from every position's
    block (rank 0 holds one process's weights), and load_pretrained() gives each position
    its block of a Hugging Face file."""
    from safetensors.torch import save_file

    _, reference = _single_process(STEPS // 2)
    states = [state for state, _ in run_world(_whole_model_views, 4, stage, None)]
    assert all(not s for s in states[1:])
    assert set(states[0]) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(states[0][name], value, rtol=1e-4, atol=WEIGHTS_ATOL)
    save_file({k: v.contiguous() for k, v in reference.items()}, tmp_path / "model.safetensors")
    results = run_world(_whole_model_views, 4, stage, str(tmp_path))
    for name, value in reference.items():
        assert torch.equal(results[0][0][name], value), name
    # What the 4 ranks read of the file: a column-wise block its own rows (each element
    # once over the ranks), a row-wise block the full rows its range spans (once a
    # position), the rest each position's ranges; at most a row more a rank per tensor.
    row_wise = {"o_proj", "down_proj"}
    column_wise = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    least = slack = 0
    for name, value in reference.items():
        layer = name.split(".")[-2]
        least += value.numel() * (1 if layer in column_wise else 2)
        if layer in row_wise | column_wise:
            slack += 4 * value.shape[1]
    assert least <= sum(read for _, read in results) <= least + slack


# ---------------------------------------------------------------------------- sequence parallel
D, S = 8, 8


def _sequence_block(seed: int = 0) -> torch.nn.Module:
    """A pre-norm MLP block: under sequence parallelism its norm works on each rank's
    sequence shard, so the norm's (replicated) weight gets a partial gradient per rank."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(D)
            self.up = torch.nn.Linear(D, 4 * D)
            self.down = torch.nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(seed)
    return Block()


def _sequence_data(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, S, D, generator=g) for _ in range(steps)]


def _sequence_parallel(rank, world, stage):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = parallelize_module(
        _sequence_block(),
        mesh["tensor"],
        {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, gradient_clipping=CLIP)
    engine = ZeroEngine(model, optimizer, config, device_mesh=mesh)
    d, t = mesh.get_local_rank("data"), mesh.get_local_rank("tensor")
    for x in _sequence_data(STEPS):
        mine = x.chunk(2)[d].chunk(2, dim=1)[t]  # this rank's batch half, sequence half
        # Each position's loss is its sequence half's; backward sums them over positions.
        loss = engine(mine).square().mean() / 2
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("stage", [1, 3])
def test_sequence_parallel_norm_gets_its_whole_gradient(stage):
    """The norm's weight, replicated over a sequence-sharded input, has a Partial
    gradient on each rank: it is summed over the tensor ranks before ZeRO reduces it, so
    training matches one process."""
    model = _sequence_block()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for x in _sequence_data(STEPS):
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    state = run_world(_sequence_parallel, 4, stage)[0]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=WEIGHTS_ATOL)


def _state_dict_round_trip(rank, world, stage):
    engine, d = _engine(2, 2, stage)
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    first = _train(engine, d, 2, batches(2, BATCH))
    engine.module.load_state_dict(saved)  # DTensors, as model.state_dict() gives them
    again = _train(engine, d, 2, batches(2, BATCH))
    kinds = {type(v).__name__ for v in saved.values()}
    engine.close()
    return first, again, kinds


@pytest.mark.parametrize("stage", [1, 3])
def test_model_state_dict_round_trip(stage):
    """model.state_dict() gives DTensors for the plan's parameters (as FSDP2 + TP does);
    loading them back restores the weights, so training repeats itself exactly (the
    optimizer's state aside: the first step's losses agree)."""
    for first, again, kinds in run_world(_state_dict_round_trip, 4, stage):
        assert kinds == {"DTensor", "Tensor"}
        assert first[0] == again[0]


# ---------------------------------------------------------------------------- meta device
def _built_on_meta(rank, world, tp, stage):
    from torch.distributed.device_mesh import init_device_mesh

    from zero_strategy import init_on_meta

    dp = world // tp
    with init_on_meta():
        model = llama()
        mesh = None
        if tp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
            apply_llama_plan(model, mesh["tensor"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage), device_mesh=mesh)
    losses = _train(engine, engine.rank, dp, batches(2, BATCH))
    state = engine.full_state_dict()
    engine.close()
    return state, losses


@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_built_on_meta_gets_the_weights_it_has_without_tensor_parallelism(stage):
    """The plan applied on the meta device; the engine materialises each rank's block:
    every position initialises the whole parameter and keeps its block, so the weights
    are those of the same model without tensor parallelism (no two shards alike), and
    training goes on as there."""
    with_tp, losses_tp = run_world(_built_on_meta, 4, 2, stage)[0]
    without, losses = run_world(_built_on_meta, 2, 1, stage)[0]
    assert set(with_tp) == set(without)
    for name, value in without.items():
        torch.testing.assert_close(with_tp[name], value, rtol=1e-4, atol=WEIGHTS_ATOL)
    _close(losses_tp, losses)


# ---------------------------------------------------------------------------- transformers' own plan
def _transformers_plan(rank, world, path, stage):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, tp_plan="auto", dtype=torch.float32
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, gradient_clipping=CLIP, tensor_parallel_size=world)
    engine = ZeroEngine(model, optimizer, config)
    losses = _train(engine, engine.rank, 1, batches(STEPS, BATCH))
    engine.close()
    return losses


def _architecture(name: str) -> torch.nn.Module:
    import transformers as T

    if name == "llama":
        return llama()
    torch.manual_seed(0)
    classes = {
        "qwen3": T.Qwen3Config,
        "phi3": T.Phi3Config,
        "olmo2": T.Olmo2Config,
        "qwen3_moe": T.Qwen3MoeConfig,
    }
    # Qwen3-MoE: every layer's MLP is 4 routed experts, whole at both positions.
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1
    )
    config = classes[name](
        **(moe if name == "qwen3_moe" else {}),
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=0,
    )
    return T.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "olmo2", "qwen3_moe"])
def test_a_model_loaded_with_transformers_tp_plan_trains_as_one_process(name, tmp_path):
    """from_pretrained(tp_plan="auto"): Transformers' own plan over the 2 ranks
    (vocab-parallel embedding, column-wise head, the blocks column-/row-wise; Phi-3's
    packed qkv and gate_up, Qwen3's and OLMo2's q/k norms; Qwen3-MoE's experts left
    whole); the engine, told tensor_parallel_size=2, trains it as one process does."""
    _architecture(name).save_pretrained(tmp_path)
    reference, _ = _single_process(STEPS, _architecture(name))
    for losses in run_world(_transformers_plan, 2, str(tmp_path), 3):
        _close(losses, reference)


# ---------------------------------------------------------------------------- a small MLP
def _mlp(width: int = 4 * D) -> torch.nn.Module:
    """The pre-norm block with `width` hidden units (5: split 3 + 2 over two positions)."""
    block = _sequence_block()
    torch.manual_seed(1)
    block.up, block.down = torch.nn.Linear(D, width), torch.nn.Linear(width, D)
    return block


def _mlp_engine(stage, tp, width=4 * D, **config):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dp = torch.distributed.get_world_size() // tp
    model, mesh = _mlp(width), None
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data", "tensor"))
        # up's output stays a DTensor: RowwiseParallel would take a plain local input
        # as an even shard. down's bias is replicated.
        plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tensor"], plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=stage, gradient_clipping=CLIP, **config)
    return ZeroEngine(model, optimizer, config, device_mesh=mesh), dp


def _mlp_loss(engine: ZeroEngine, x: torch.Tensor) -> torch.Tensor:
    x = x.to(engine.module.norm.weight.dtype)  # bf16 compute: bf16 inputs
    return engine(x).float().square().mean()


def _mlp_train(engine, dp, steps=STEPS):
    return _train(engine, engine.rank, dp, _sequence_data(steps), _mlp_loss)


def _mlp_case(rank, world, case, stage, tp):
    if case == "uneven buckets":  # 5 hidden units, buckets of 36 elements
        engine, dp = _mlp_engine(stage, tp, width=5, bucket_size=36)
        result = _mlp_train(engine, dp)
    elif case in ("bf16", "fp16"):
        engine, dp = _mlp_engine(stage, tp, compute_dtype=case)
        result = (_mlp_train(engine, dp), str(engine.module.up.weight.dtype))
    elif case == "load_state_dict":  # down.bias is a replicated DTensor
        engine, dp = _mlp_engine(stage, tp)
        saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        first = _mlp_train(engine, dp, 2)
        engine.module.load_state_dict(saved)
        result = (first, _mlp_train(engine, dp, 2))
    elif case == "modifier":  # global rank 1 writes; every rank takes its values
        engine, dp = _mlp_engine(stage, tp)
        with engine.gathered_parameters(modifier_rank=1):
            if rank == 1:
                torch.set_grad_enabled(False)
                engine.module.norm.weight.fill_(7.0)
                engine.module.up.bias.fill_(3.0)  # its own block of it
                torch.set_grad_enabled(True)
        result = engine.full_state_dict(rank0_only=False)
        result = (result["norm.weight"], result["up.bias"])
    elif case in ("converted", "plain"):  # model.to() after the engine, or not
        engine, dp = _mlp_engine(stage, tp)
        if case == "converted":
            engine.module.to("cpu")
        result = _mlp_train(engine, dp)
    engine.close()
    return result


@pytest.mark.parametrize("stage", [1, 3])
def test_uneven_shards_with_small_buckets_train_as_without_tensor_parallelism(stage):
    """5 hidden units split 3 + 2: positions hold different amounts, but cut their
    buckets alike (by the largest block), so their collectives pair up."""
    with_tp = run_world(_mlp_case, 4, "uneven buckets", stage, 2)[0]
    without = run_world(_mlp_case, 2, "uneven buckets", stage, 1)[0]
    _close(with_tp, without)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_reduced_precision_with_tensor_parallelism(stage, dtype):
    """The DTensor parameters compute in bf16/fp16 (their dtype says so; fp16 with the
    loss scale, its overflow check spanning the tensor ranks) and train as the model
    without tensor parallelism does, within the dtype's rounding."""
    (with_tp, got), (without, _) = (
        run_world(_mlp_case, 4, dtype, stage, 2)[0],
        run_world(_mlp_case, 2, dtype, stage, 1)[0],
    )
    assert got == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    _close(with_tp, without, rel=1e-2)


@pytest.mark.parametrize("stage", [1, 3])
def test_load_state_dict_with_replicated_dtensors(stage):
    for first, again in run_world(_mlp_case, 4, "load_state_dict", stage, 2):
        assert first[0] == again[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_modifier_rank_reaches_every_tensor_position(stage):
    """gathered_parameters(modifier_rank=1): global rank 1 (tensor position 1) writes a
    whole parameter and its own block of a sharded one; every rank ends with its
    whole-parameter values, and the sharded one's block at position 1 from it."""
    for norm, up_bias in run_world(_mlp_case, 4, "modifier", stage, 2):
        assert torch.equal(norm, torch.full((D,), 7.0))
        assert torch.equal(up_bias[2 * D :], torch.full((2 * D,), 3.0))
        assert not torch.equal(up_bias[: 2 * D], torch.full((2 * D,), 3.0))


def test_module_conversion_after_the_engine_keeps_training():
    """model.to() swaps a DTensor parameter's contents (and unwires its hooks): the
    engine wires them again at the next forward, and training goes on as without it."""
    converted = run_world(_mlp_case, 4, "converted", 3, 2)[0]
    _close(converted, run_world(_mlp_case, 4, "plain", 3, 2)[0])


# ---------------------------------------------------------------------------- meshes of several dimensions
def _blocks_on_a_2d_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from zero_strategy.tensor_parallel import placement_of

    full = torch.arange(7 * 6, dtype=torch.float32).view(7, 6)
    out = []
    for shape, placements in [
        ((4, 1), (Shard(0), Replicate())),  # Transformers' (tp, unit_replicate)
        ((2, 2), (Shard(0), Shard(1))),
        ((2, 2), (Shard(0), Shard(0))),  # 7 rows: 4 + 3, then 2 + 2 and 2 + 1
        ((2, 2), (Replicate(), Shard(1))),
    ]:
        mesh = init_device_mesh("cpu", shape)
        p = torch.nn.Parameter(distribute_tensor(full, mesh, list(placements)))
        placed = placement_of(p)
        starts, size = placed.block(placed.position)
        where = tuple(slice(a, a + n) for a, n in zip(starts, size))
        out.append(torch.equal(full[where], p.to_local()) and placed.size == 4)
    return out


def test_a_dtensor_on_a_mesh_of_several_dimensions_has_its_block_where_dtensor_puts_it():
    """Transformers puts some weights on a (tp, 1) mesh; a mesh may have several
    dimensions that split: each rank's block is where DTensor put its local shard."""
    for found in run_world(_blocks_on_a_2d_mesh, 4):
        assert found == [True] * 4
