"""torch.compile with the engine at every stage: the model compiled whole before it is
handed over, `engine.module` compiled after, and each block compiled (torchtitan's
recipe), all train with eager's losses; after two steps nothing recompiles, in training
or in evaluation; the graph breaks are the engine's hooks, counted."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from tests.distributed import preload, run_world, warm_the_compiler
from tests.training import TINY, local_batch, make_model, make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.tensor_parallel import SHARD_INSIDE_A_STORAGE_COMPILES

# What the ranks would each import or make again: the compiler's state, the Transformers
# models they build, the Accelerate door.
warm_the_compiler()
preload(
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "zero_strategy.integrations.accelerate",
)

MODES = ("eager", "before", "after", "blocks")
# Compiled after the hand-over, `engine.module` is the very module the engine calls when the
# model was compiled before it: the small GPT's runs pin "after" at every stage, the MoE and
# Transformers runs take the other two modes.
WHOLE_OR_BLOCKS = ("eager", "before", "blocks")
STEPS = 4


def _fresh_dynamo() -> None:
    """Each run compiles from nothing and counts only its own graphs and breaks."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _graphs_made() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _compiled_before(
    model: torch.nn.Module,
    mode: str,
    fullgraph: bool = True,
    backend: str = "inductor",
    blocks: Iterable[torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """What `mode` does before the hand-over: compile the model whole ("before"), or each
    of its `blocks` (the small GPT's `model.blocks` unless given; with fullgraph=True: no
    engine hook may run inside a block) ("blocks"); the other modes leave it as it is."""
    if mode == "before":
        return torch.compile(model, backend=backend)
    if mode == "blocks":
        for block in model.blocks if blocks is None else blocks:
            block.compile(fullgraph=fullgraph, backend=backend)
    return model


def _steps(
    model, backward, optimizer, rank, world, steps=STEPS, cfg=TINY, evaluated=None
) -> list[float]:
    """The plain loop through a door: forward, the door's backward, step, zero_grad;
    compiled by step 2, after which any recompile raises. With a list `evaluated`, each
    step is followed by an evaluation forward (eval mode, no grad), whose loss it gets."""
    losses = []
    try:
        for step in range(steps):
            torch._dynamo.config.error_on_recompile = step >= 2
            x, y = local_batch(step, 0, rank, world, cfg)
            loss = model(x, y)
            backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if evaluated is not None:
                modes = getattr(model, "module", model)  # the engine's, or the module's own
                modes.eval()
                with torch.no_grad():
                    evaluated.append(model(x, y).item())
                modes.train()
    finally:
        torch._dynamo.config.error_on_recompile = False
    return losses


def _engine_step(run, engine, step, rank, world) -> float:
    """One training step of the plain engine loop through `run` (the engine, or the
    module compiled after the hand-over); its loss."""
    loss = run(*local_batch(step, 0, rank, world))
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.item()


def _train(rank, world, stage, mode, compute_dtype="fp32", backend="inductor"):
    _fresh_dynamo()
    model = _compiled_before(make_model(), mode, backend=backend)
    engine = ZeroEngine(
        model, make_optimizer(model), ZeroConfig(stage=stage, compute_dtype=compute_dtype)
    )
    run = torch.compile(engine.module, backend=backend) if mode == "after" else engine
    losses, evaluated = [], []
    try:
        for step in range(STEPS):
            if step == 2:  # compiled by now: any later recompile raises
                torch._dynamo.config.error_on_recompile = True
            losses.append(_engine_step(run, engine, step, rank, world))
            with torch.no_grad():
                evaluated.append(run(*local_batch(step, 0, rank, world)).item())
    finally:
        torch._dynamo.config.error_on_recompile = False
        engine.close()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return losses, evaluated, breaks


def _every_mode(rank, world, stage, compute_dtype="fp32", modes=MODES, backend="inductor"):
    """Each mode in turn in the same processes (one start-up for all of them)."""
    return {mode: _train(rank, world, stage, mode, compute_dtype, backend) for mode in modes}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_training_equals_eager_in_every_mode(stage):
    """Losses within 1e-4 relative of eager for the three compile modes, with no
    recompile after step 2 (training and evaluation forwards). The graph breaks are
    pinned: compiled whole (before or after the hand-over) the model breaks only where the
    engine's module hooks run (kept out of the graph, as FSDP2 keeps its own: they gather,
    publish, free and check the ranks' order), 4 times over the run for this 2-block model
    at stages 1-3 and never at stage 0 (no hooks); each block compiles as one graph
    (fullgraph=True) at every stage. A new break shows up here. Inductor compiles stage
    3; aot_eager (dynamo's tracing and AOT autograd, where the engine's hooks and tensors
    meet the compiler, without code generation) the others, for the suite's time."""
    backend = "inductor" if stage == 3 else "aot_eager"
    results = run_world(_every_mode, 2, stage, "fp32", MODES, backend, timeout=900)[0]
    eager_losses, eager_eval, _ = results["eager"]
    for mode in MODES[1:]:
        losses, evaluated, breaks = results[mode]
        assert losses == pytest.approx(eager_losses, rel=1e-4), mode
        assert evaluated == pytest.approx(eager_eval, rel=1e-4), mode
        if mode == "blocks" or stage == 0:
            assert breaks == {}, mode
        else:
            assert all("_run_engine_hook" in reason for reason in breaks), breaks
            assert sum(breaks.values()) == 4, breaks


def _reads_between_compiled_steps(rank, world, mode):
    """Stage 3, compiled: between steps the parameters are read as DDP code reads them
    (a shape, a weight by name, every weight over `model.parameters()`); the marks the
    freed units' parameters carry make no recompile after step 2."""
    _fresh_dynamo()
    model = _compiled_before(make_model(), mode, backend="aot_eager")
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    run = torch.compile(engine.module, backend="aot_eager") if mode == "after" else engine
    losses, read, shapes = [], [], set()
    try:
        for step in range(STEPS):
            if step == 2:
                torch._dynamo.config.error_on_recompile = True
            weight = engine.module.blocks[1].fc.weight
            shapes.add(tuple(weight.shape))
            read.append(weight.sum().item())
            read.append(sum(p.double().sum().item() for p in engine.module.parameters()))
            losses.append(_engine_step(run, engine, step, rank, world))
    finally:
        torch._dynamo.config.error_on_recompile = False
        engine.close()
    return losses, read, shapes


def test_parameters_read_between_compiled_steps_make_no_recompile():
    eager_losses, eager_read, shapes = run_world(_reads_between_compiled_steps, 2, "eager")[0]
    assert shapes == {tuple(make_model().blocks[1].fc.weight.shape)}
    assert all(r == r for r in eager_read)  # not NaN: the values, not the placeholders
    for mode in ("before", "after"):
        losses, read, _ = run_world(_reads_between_compiled_steps, 2, mode)[0]
        assert losses == pytest.approx(eager_losses, rel=1e-4), mode
        assert read == pytest.approx(eager_read, rel=1e-4), mode


def test_compiled_bf16_stage_3_equals_eager():
    """bf16 compute (fp32 masters) at stage 3, the model compiled whole: eager's losses
    within bf16's reordering. Traced with aot_eager: the engine's casts meet the compiler
    in dynamo and AOT autograd; inductor's bf16 code generation is the compiler's own
    concern, and the fp32 run above takes stage 3 through inductor end to end."""
    modes = ("eager", "before")
    results = run_world(_every_mode, 2, 3, "bf16", modes, "aot_eager", timeout=600)[0]
    assert results["before"][0] == pytest.approx(results["eager"][0], rel=1e-2)


def _lightning_fit(rank, world, how):
    """`how`: "eager"; "fit" hands `trainer.fit` the compiled module; "configure_model"
    builds the model in the hook and compiles each block there (Lightning's recipe for
    sharded strategies), against "configure_model_eager", built there alike (the
    strategy initialises a model built in the hook itself)."""
    import os

    import lightning as L
    from lightning_helpers import loader, quiet_trainer

    _fresh_dynamo()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")

    class Module(L.LightningModule):
        """A training step dynamo can trace (Lightning's `self.log` inside a compiled
        training_step fails under DDP too, in Lightning 2.6 with torch 2.13)."""

        def __init__(self):
            super().__init__()
            self.model = None if how.startswith("configure_model") else make_model()
            self.losses: list[float] = []

        def configure_model(self):
            if self.model is None:
                self.model = make_model()
                if how == "configure_model":
                    for block in self.model.blocks:
                        block.compile(fullgraph=True, backend="aot_eager")

        def forward(self, x, y):
            return self.model(x, y)

        def training_step(self, batch, batch_idx):
            return self(*batch)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self):
            return make_optimizer(self.model)

    module = Module()
    trainer = quiet_trainer(world, "zero3", max_steps=4, num_sanity_val_steps=0)
    compiled = torch.compile(module, backend="aot_eager") if how == "fit" else module
    trainer.fit(compiled, loader(n_batches=4, world=world))
    return module.losses, _graphs_made()


def _lightning_fits(rank, world):
    hows = ("eager", "fit", "configure_model_eager", "configure_model")
    return {how: _lightning_fit(rank, world, how) for how in hows}


def test_lightning_trains_compiled_at_stage_3():
    """`trainer.fit(torch.compile(model))`, Lightning's own convention, and blocks
    compiled in `configure_model`: the model runs compiled (graphs were made) with
    eager's losses. Through aot_eager: what Lightning does with a compiled module (unwrap
    it, set the strategy up, compile again with the same arguments) does not depend on
    the backend, and the dense runs above take stage 3 through inductor."""
    pytest.importorskip("lightning")
    results = run_world(_lightning_fits, 2, timeout=900)[0]
    for how, eager in (("fit", "eager"), ("configure_model", "configure_model_eager")):
        compiled, graphs = results[how]
        assert results[eager][1] == 0 < graphs, how
        assert compiled == pytest.approx(results[eager][0], rel=1e-4), how


def _fabric_loop(rank, world, compiled):
    import os

    import lightning as L

    _fresh_dynamo()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    fabric.launch()  # ranks already exist (as under torchrun): this only sets up
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer = fabric.setup(torch.compile(model) if compiled else model, optimizer)
    return _steps(model, fabric.backward, optimizer, rank, world), _graphs_made()


def test_fabric_sets_up_a_compiled_model_at_stage_3():
    """`fabric.setup(torch.compile(model), optimizer)`: Fabric unwraps the compiled
    module, the strategy shards it, and Fabric compiles the result again; it trains
    compiled with eager's losses."""
    pytest.importorskip("lightning")
    eager, _ = run_world(_fabric_loop, 2, False, timeout=600)[0]
    compiled, graphs = run_world(_fabric_loop, 2, True, timeout=600)[0]
    assert graphs > 0
    assert compiled == pytest.approx(eager, rel=1e-4)


def _accelerate_loop(rank, world, backend):
    import os

    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    _fresh_dynamo()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    extra = {"dynamo_backend": backend} if backend else {}
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3), cpu=True, **extra)
    model = make_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    return _steps(model, accelerator.backward, optimizer, rank, world), _graphs_made()


def test_accelerate_compiles_with_its_dynamo_backend_at_stage_3():
    """`Accelerator(dynamo_backend="inductor")` (what `accelerate launch --dynamo_backend`
    sets): `prepare` compiles the sharded model; it trains compiled with eager's losses."""
    pytest.importorskip("accelerate")
    eager, _ = run_world(_accelerate_loop, 2, None, timeout=600)[0]
    compiled, graphs = run_world(_accelerate_loop, 2, "inductor", timeout=600)[0]
    assert graphs > 0
    assert compiled == pytest.approx(eager, rel=1e-4)


def _moe_modes(rank, world, stage, compute_dtype="fp32", modes=WHOLE_OR_BLOCKS, evaluate=False):
    """Each mode's training losses (with `evaluate`, followed by each step's evaluation
    loss: forwards with graphs of their own), the graphs made and the breaks."""
    from test_moe import MOE, moe_model

    out = {}
    for mode in modes:
        _fresh_dynamo()
        # An MoE block breaks inside, at its routing (token counts the data decides) and
        # at its experts (a unit of their own, on their expert-data-parallel group):
        # blocks are compiled without fullgraph.
        model = _compiled_before(moe_model(2), mode, fullgraph=False, backend="aot_eager")
        config = ZeroConfig(stage=stage, compute_dtype=compute_dtype)
        engine = ZeroEngine(model, make_optimizer(model), config)
        run = torch.compile(engine.module, backend="aot_eager") if mode == "after" else engine
        evaluated = [] if evaluate else None
        losses = _steps(run, engine.backward, engine, rank, world, 3, MOE, evaluated)
        losses = losses + evaluated if evaluate else losses
        engine.close()
        out[mode] = (losses, _graphs_made(), dict(torch._dynamo.utils.counters["graph_break"]))
    return out


# Where a compiled MoE GPT may break: the engine's hooks; the routing, at its token
# selection (`nonzero`: how many tokens each expert gets is the data's) and its scatter of
# rows (an in-place `index_copy_` in its autograd Function, which dynamo does not trace);
# and the dispatch between ranks, kept eager (`moe/dispatch.py`). Nothing else: not the
# communicator's counters (once traced, guarded on and refused inside the all-to-all's
# autograd Function), not the splits' Python ints.
MOE_BREAKS = (
    "_run_engine_hook",
    "aten.nonzero",
    "Tensor.index_copy_",
    "_exchange",
    "_by_expert",
    "Function.apply",
    "_AllToAll.apply",  # (torch 2.14 names the disabled function itself)
)


def _assert_moe_breaks(breaks: dict[str, int]) -> None:
    strays = [reason for reason in breaks if not any(at in reason for at in MOE_BREAKS)]
    assert not strays, strays


# Stages 0-2 hand the compiler the same module (parameters as views of a persistent flat
# buffer; stage 0 without the engine's hooks, which the dense model's test pins at each
# stage): stage 2 stands for them, stage 3 for the copy made at each gather.
SHARDING_STAGES = [2, 3]


@pytest.mark.parametrize("stage", SHARDING_STAGES)
def test_moe_expert_parallel_compiles_whole_or_per_block(stage):
    """An MoE GPT with experts over 2 expert-parallel ranks, compiled whole or per block,
    trains with eager's losses, does not recompile after step 2, and breaks only where
    MOE_BREAKS says (the routing's all-to-all runs between graphs). At stage 3 (the
    gathers in every forward) each step is followed by an evaluation forward, with eager's
    loss and no recompile after step 2 either: 40% more compile time, so not at stage 2
    too."""
    results = run_world(_moe_modes, 2, stage, evaluate=stage == 3, timeout=600)[0]
    eager = results["eager"][0]
    for mode in WHOLE_OR_BLOCKS[1:]:
        losses, graphs, breaks = results[mode]
        assert graphs > 0, mode
        assert losses == pytest.approx(eager, rel=1e-4), mode
        _assert_moe_breaks(breaks)


def test_moe_expert_parallel_compiles_in_bf16_at_stage_3():
    """The same in bf16 compute: compiled whole or per block, eager's losses within bf16's
    reordering (as the dense model's bf16 run)."""
    results = run_world(_moe_modes, 2, 3, "bf16", timeout=600)[0]
    eager = results["eager"][0]
    for mode in WHOLE_OR_BLOCKS[1:]:
        losses, graphs, _ = results[mode]
        assert graphs > 0, mode
        assert losses == pytest.approx(eager, rel=1e-2), mode


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # compiled RNG differs
    return GPT2LMHeadModel(config)


def _hf_train(engine: ZeroEngine, id_batches, evaluate: bool = False) -> list[float]:
    """Transformers' loop over batches of token ids (labels the ids): compiled in steps
    0-1, after which any recompile raises; with `evaluate`, each step is followed by a
    no-grad forward. The losses; the engine is closed at the end."""
    losses = []
    try:
        for step, ids in enumerate(id_batches):
            torch._dynamo.config.error_on_recompile = step >= 2
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
            if evaluate:
                with torch.no_grad():
                    engine(input_ids=ids, labels=ids)
    finally:
        torch._dynamo.config.error_on_recompile = False
        engine.close()
    return losses


def _hf_modes(rank, world, stage):
    """A Transformers GPT-2 in each mode; `aot_eager` traces and differentiates as
    inductor does (fake tensors, functionalisation: where stage 3 failed) without its
    code generation, which is the model's and not the engine's concern. Compiling
    `engine.module` after the hand-over compiles the same module as compiling it before
    (the engine calls that wrapper), so "after" is left to the small GPT's runs."""
    out = {}
    for mode in WHOLE_OR_BLOCKS:
        _fresh_dynamo()
        gpt2 = _hf_gpt2()
        model = _compiled_before(gpt2, mode, backend="aot_eager", blocks=gpt2.transformer.h)
        engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
        generator = torch.Generator().manual_seed(rank)
        id_batches = [torch.randint(100, (2, 16), generator=generator) for _ in range(3)]
        losses = _hf_train(engine, id_batches, evaluate=True)
        out[mode] = losses, dict(torch._dynamo.utils.counters["graph_break"])
    return out


# The engine's hook breaks over the run (training and evaluation forwards of 2 blocks,
# 3 steps), compiled whole: none at stage 0 (no module hooks); as many at stages 1-2 (the
# publish waits) as at stage 3 (the gathers, frees and order checks), at the same hooks.
HF_ENGINE_BREAKS = {2: 14, 3: 14}


@pytest.mark.parametrize("stage", SHARDING_STAGES)
def test_a_transformers_model_compiles_in_every_mode(stage):
    """Transformers' GPT-2, compiled whole before the hand-over or per
    block: eager's losses, no recompile after step 2, each block one graph, and compiled
    whole it breaks only at the engine's hooks (counted) and Transformers' logger (at
    stage 3 the model is marked sharded for `generate()`; with FSDP's pair of marks
    dynamo takes it as FSDP2's modules, instead of breaking at it)."""
    pytest.importorskip("transformers")
    results = run_world(_hf_modes, 2, stage, timeout=900)[0]
    eager, _ = results["eager"]
    for mode in WHOLE_OR_BLOCKS[1:]:
        losses, breaks = results[mode]
        assert losses == pytest.approx(eager, rel=1e-4), mode
        if mode == "blocks":
            assert breaks == {}
            continue
        ours = sum(n for reason, n in breaks.items() if "_run_engine_hook" in reason)
        theirs = [reason for reason in breaks if "_run_engine_hook" not in reason]
        assert ours == HF_ENGINE_BREAKS[stage], breaks
        # Transformers' own: a logger warning inside its forward.
        assert all("logging.Logger" in reason for reason in theirs), theirs


def _hf_moe_modes(rank, world):
    """A Transformers Mixtral with its experts over 2 expert-parallel ranks (converted by
    the engine), stage 3, in each mode; 3 steps, no recompile after step 2."""
    from test_hf_moe import PER_RANK, build, global_batches

    out = {}
    for mode in WHOLE_OR_BLOCKS:
        _fresh_dynamo()
        mixtral = build("mixtral")
        layers = mixtral.model.layers  # MoE layers break inside: not fullgraph
        model = _compiled_before(mixtral, mode, False, "aot_eager", blocks=layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, expert_parallel_size=2))
        own_part = [batch.split(PER_RANK)[rank] for batch in global_batches(world, 3)]
        losses = _hf_train(engine, own_part)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        out[mode] = losses, _graphs_made(), breaks
    return out


def test_a_transformers_moe_model_compiles_expert_parallel():
    """Transformers' Mixtral, its experts over 2 ranks at stage 3, compiled whole before
    the hand-over or per decoder layer: eager's losses, no recompile after step 2, and the
    dispatch between ranks kept out of the graphs (`moe/dispatch.py`): no break inside
    the all-to-all's autograd Function, where the communicator's counters once were
    traced. (Transformers' own breaks, its output-capturing hooks, lock and context
    variable, are not the engine's.)"""
    pytest.importorskip("transformers")
    results = run_world(_hf_moe_modes, 2, timeout=600)[0]
    eager = results["eager"][0]
    for mode in WHOLE_OR_BLOCKS[1:]:
        losses, graphs, breaks = results[mode]
        assert graphs > 0, mode
        assert losses == pytest.approx(eager, rel=1e-4), mode
        assert any("_exchange" in reason for reason in breaks), breaks
        assert not [reason for reason in breaks if "side effect" in reason], breaks


def _names_when_compiled_before(rank, world):
    _fresh_dynamo()
    model = make_model()
    names = list(model.state_dict())
    engine = ZeroEngine(torch.compile(model), make_optimizer(model), ZeroConfig(stage=3))
    x, y = local_batch(0, 0, rank, world)
    engine.backward(engine(x, y))
    engine.step()
    sharded_names = list(engine.full_state_dict())
    engine.close()
    return names, sharded_names, engine.module is model, _graphs_made()


def test_a_model_compiled_before_the_hand_over_keeps_its_own_names():
    """`ZeroEngine(torch.compile(model), ...)` shards the module inside the wrapper: the
    state dict (and so every checkpoint) has the model's names, not `_orig_mod.` ones,
    `engine.module` is the user's model, and the engine's forward runs compiled."""
    names, sharded_names, module_is_model, graphs = run_world(_names_when_compiled_before, 2)[0]
    assert sorted(sharded_names) == sorted(names)
    assert module_is_model and graphs > 0


def _tensor_parallel_compiled(rank, world, runs):
    """Each (stage, mode) of `runs` on a Llama under a (data 2 x tensor 2) plan, compiled
    with aot_eager (dynamo's tracing and AOT autograd: where DTensors are faked), 3 steps;
    the losses and the graphs made. One decoder layer: the subject is the DTensor shards
    under the compiler, which one layer holds as two do; several blocks compiled in turn
    are the dense and Transformers runs' subject (a second layer here cost a third more
    tracing on 4 ranks)."""
    from tensor_parallel_models import apply_llama_plan, batches, llama, loss_of
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    out = {}
    for stage, mode, *dtype in runs:
        _fresh_dynamo()
        llama_tp = apply_llama_plan(llama(layers=1), mesh["tensor"])
        blocks = llama_tp.model.layers
        model = _compiled_before(llama_tp, mode, backend="aot_eager", blocks=blocks)
        config = ZeroConfig(stage=stage, compute_dtype=dtype[0] if dtype else "fp32")
        engine = ZeroEngine(model, make_optimizer(model), config, device_mesh=mesh)
        run = torch.compile(engine.module, backend="aot_eager") if mode == "after" else engine
        losses = _compiled_steps(engine, batches(3, 4), lambda ids, run=run: loss_of(run, ids))
        out[stage, mode] = losses, _graphs_made()
    return out


def _compiled_steps(engine: ZeroEngine, batches, loss_of) -> list[float]:
    """A step on this data-parallel rank's half of each batch (`loss_of(ids)`), compiled by
    step 2, after which any recompile raises; the engine closed after."""
    losses = []
    try:
        for step, batch in enumerate(batches):
            if step == 2:
                torch._dynamo.config.error_on_recompile = True
            loss = loss_of(batch.chunk(2)[engine.rank])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
    finally:
        torch._dynamo.config.error_on_recompile = False
        engine.close()
    return losses


# Stage 1 stands for stages 0-2 (a shard's own storage is a slice of the persistent flat
# buffer at each), stage 3 for the copy made at each gather; "after" is left to the small
# GPT's runs (WHOLE_OR_BLOCKS).
TENSOR_PARALLEL_RUNS = [
    (1, "eager"),
    (1, "blocks"),
    (3, "eager"),
    (3, "blocks"),
    (3, "before"),
]


def test_tensor_parallelism_compiles_in_each_mode():
    """Under tensor parallelism (dp 2 x tp 2), blocks compiled whole (fullgraph) at
    stages 1 and 3, and at stage 3 the model compiled whole before the hand-over, train
    with eager's losses, and do not recompile after step 2.
    torch cannot fake a DTensor shard that starts inside a storage (the expected failure
    below); the engine gives each shard a storage of its own."""
    pytest.importorskip("transformers")
    for out in run_world(_tensor_parallel_compiled, 4, TENSOR_PARALLEL_RUNS, timeout=900):
        for (stage, mode), (losses, graphs) in out.items():
            if mode != "eager":
                assert graphs > 0, (stage, mode)
                assert losses == pytest.approx(out[stage, "eager"][0], rel=1e-4), (stage, mode)


def test_tensor_parallelism_compiles_in_bf16():
    """The same at stage 3 in bf16 compute (fp32 masters): blocks compiled whole, and the
    model compiled before the hand-over, with eager's losses within bf16's reordering (as
    the dense and MoE bf16 runs)."""
    pytest.importorskip("transformers")
    runs = [(3, "eager", "bf16"), (3, "blocks", "bf16"), (3, "before", "bf16")]
    for out in run_world(_tensor_parallel_compiled, 4, runs, timeout=900):
        for (stage, mode), (losses, graphs) in out.items():
            if mode != "eager":
                assert graphs > 0, mode
                assert losses == pytest.approx(out[stage, "eager"][0], rel=1e-2), mode


def _moe_tensor_parallel_compiled(rank, world, modes):
    """Mixtral under its own plan (dp 2 x tp 2) with 2 of its 4 experts per data rank, at
    stage 3, in each of `modes` (aot_eager); the losses and the graphs made."""
    from test_tensor_parallel_moe import apply_model_plan, batches, build
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    out = {}
    for mode in modes:
        _fresh_dynamo()
        mixtral = apply_model_plan(build("mixtral"), mesh["tensor"])
        layers = mixtral.model.layers
        model = _compiled_before(mixtral, mode, False, "aot_eager", blocks=layers)
        config = ZeroConfig(stage=3, expert_parallel_size=2)
        engine = ZeroEngine(model, make_optimizer(model), config, device_mesh=mesh)
        losses = _compiled_steps(
            engine, batches(2, 3), lambda ids, run=engine: run(input_ids=ids, labels=ids).loss
        )
        out[mode] = losses, _graphs_made()
    return out


def test_an_moe_model_under_tensor_and_expert_parallelism_compiles():
    """Tensor parallelism and expert parallelism together at stage 3: each decoder layer
    compiled, or the model compiled before the hand-over, trains with eager's losses and
    does not recompile after step 2."""
    pytest.importorskip("transformers")
    runs = ["eager", "blocks", "before"]
    for out in run_world(_moe_tensor_parallel_compiled, 4, runs, timeout=900):
        for mode in runs[1:]:
            losses, graphs = out[mode]
            assert graphs > 0, mode
            assert losses == pytest.approx(out["eager"][0], rel=1e-4), mode


_DTENSOR_AT_AN_OFFSET = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29605"))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
weight = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
flat = torch.zeros(100)
flat[8:24].copy_(weight._local_tensor.flatten())
weight._local_tensor.data = flat[8:24].view(4, 4)  # as a unit's flat buffer holds it
linear = torch.compile(lambda x: x @ weight.redistribute(mesh, [Replicate()]).to_local(),
                       backend="aot_eager")
try:
    linear(torch.ones(2, 4))
finally:
    dist.destroy_process_group()
"""


@pytest.mark.xfail(
    not SHARD_INSIDE_A_STORAGE_COMPILES,
    strict=True,
    reason="torch 2.13: dynamo cannot fake a DTensor shard at an offset",
)
def test_torch_compiles_a_dtensor_whose_shard_starts_inside_a_storage():
    """The torch limit the engine works around before torch 2.14 (a DTensor shard on a
    storage of its own, a copy at stage 3: `SHARD_INSIDE_A_STORAGE_COMPILES`), bare:
    expected to fail where the engine takes it to, and to pass where it does not."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DTENSOR_AT_AN_OFFSET], capture_output=True)
    error = out.stderr.decode()
    if out.returncode and "storage on different device" not in error:
        raise RuntimeError(error[-800:])  # another failure than the known limit: a real one
    assert out.returncode == 0, "the known limit"


def _offloaded(rank, world, offload_dir):
    out = {}
    for mode in ("eager", "blocks"):
        _fresh_dynamo()
        model = _compiled_before(make_model(), mode)
        config = ZeroConfig(
            stage=3, offload_params="disk", offload_optimizer="disk", offload_dir=offload_dir
        )
        engine = ZeroEngine(model, make_optimizer(model), config)
        out[mode] = _steps(engine, engine.backward, engine, rank, world, steps=3), _graphs_made()
        engine.close()
    return out


def test_offloaded_parameters_and_optimizer_state_compile(tmp_path):
    """Stage 3 with parameters and optimizer state on disk, blocks compiled whole
    (fullgraph): the tiers' reads and writes are in the engine's hooks, outside the
    graphs, so the combination compiles and trains with eager's losses."""
    results = run_world(_offloaded, 2, str(tmp_path), timeout=600)[0]
    (eager, _), (compiled, graphs) = results["eager"], results["blocks"]
    assert graphs > 0
    assert compiled == pytest.approx(eager, rel=1e-4)


def _lightning_tensor_parallel(rank, world, compiled):
    import lightning as L
    from lightning_helpers import quiet_trainer
    from tensor_parallel_models import apply_llama_plan, batches, llama, loss_of
    from torch.utils.data import DataLoader, TensorDataset

    from zero_strategy.integrations.lightning import ZeroStrategy

    _fresh_dynamo()

    class Llama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama(layers=1)  # one decoder layer: see _tensor_parallel_compiled
            self.losses: list[float] = []

        def configure_model(self):
            apply_llama_plan(self.model, self.device_mesh["tensor_parallel"])

        def training_step(self, batch, batch_idx):
            loss = loss_of(self.model, batch[0])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    module = Llama()
    trainer = quiet_trainer(world, ZeroStrategy(stage=3, tensor_parallel_size=2), max_steps=3)
    data = DataLoader(TensorDataset(torch.cat(batches(3, 4))), batch_size=2)
    trainer.fit(torch.compile(module, backend="aot_eager") if compiled else module, data)
    return module.losses, _graphs_made()


def test_lightning_tensor_parallel_fits_a_compiled_module():
    """`trainer.fit(torch.compile(model))` with `ZeroStrategy(tensor_parallel_size=2)`
    trains compiled, with eager's losses."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    eager = run_world(_lightning_tensor_parallel, 4, False, timeout=600)
    compiled = run_world(_lightning_tensor_parallel, 4, True, timeout=600)
    for (losses, graphs), (want, _) in zip(compiled, eager):
        assert graphs > 0
        assert losses == pytest.approx(want, rel=1e-4)
