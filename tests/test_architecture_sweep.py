"""Every architecture of the installed transformers that a task's auto mapping names,
chosen by rule: the causal-LM, sequence-to-sequence, masked-LM, image-classification,
audio-classification, CTC and image-text-to-text mappings. Each is built tiny
(`tiny_configs.py`) and fed by rule (`_candidate_shapes`: token ids, an image, a waveform
or a spectrogram, whichever its main input takes; a vision-language model, images and
their placeholders, `vision_language_inputs.py`). On 2 ranks at stage 3: it trains as
under torch's DDP to the bit (with its LayerDrop, where it has one, at 0.5), with
Transformers' gradient checkpointing too; a vision-language model does so while one rank,
then both, see no image; it loads `save_pretrained`'s weights by shards as
`from_pretrained` does; with experts, it trains expert-parallel as under DDP, or is
refused by name; with parameters it marks to stay in fp32, it trains in bf16 compute at
stage 3 as at stage 0, those parameters in fp32; a causal LM whose config ships a
tensor-parallel plan, loaded with it over 2 ranks, trains under the engine as under the
optimizer alone.

An architecture that cannot be built tiny, that takes none of the inputs the rule makes,
or that DDP itself cannot train so, is skipped with the reason: not a finding about this
engine. Not in the default run (460 architectures, 16-18 minutes):
`bash scripts/test.sh -m sweep tests/test_architecture_sweep.py`."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from test_pretrained_doors import load_by_shards, saved_tiny
from vision_language_inputs import VisionLanguageInputs

from distributed import run_world
from tiny_configs import setting, tiny_model
from training import step_and_state, with_lora
from zero_strategy import ZeroConfig, ZeroEngine

transformers = pytest.importorskip("transformers")
from transformers.models.auto import modeling_auto  # noqa: E402

# Each auto class of language, vision and speech models, with the architectures its
# mapping names.
FAMILIES = {
    "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForSeq2SeqLM": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForMaskedLM": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "AutoModelForImageClassification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForAudioClassification": modeling_auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
    "AutoModelForCTC": modeling_auto.MODEL_FOR_CTC_MAPPING_NAMES,
}
CASES = [(family, name) for family, names in FAMILIES.items() for name in sorted(names)]
# Vision-language models: trained with inputs of their own (`vision_language_inputs.py`).
VISION_LANGUAGE = "AutoModelForImageTextToText"
VISION_LANGUAGE_CASES = sorted(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
# Families whose pretrained weights the sweep loads by shards: all of them.
LOAD_CASES = CASES + [(VISION_LANGUAGE, name) for name in VISION_LANGUAGE_CASES]
# Families whose labels are one class a sample, and CTC's (a short transcript a sample).
ONE_LABEL = ("AutoModelForImageClassification", "AutoModelForAudioClassification")

pytestmark = pytest.mark.sweep
STEPS, BATCH, SEQ = 3, 4, 16
# Where a model has LayerDrop (wav2vec2, HuBERT, BART's encoder and decoder...), every
# rank drops alike (one seed), so a dropped layer gets no gradient on any rank and its
# parameters must skip the step, count and all, as under DDP: on half the time, it does.
# (Off where DDP itself cannot train the model with it on: Pegasus-X's LayerDrop fails.)
LAYERDROP = 0.5


def _train(
    rank,
    world,
    family,
    model_type,
    stage,
    sgd=False,
    checkpointing=False,
    layerdrop=0.0,
    dtypes=False,
    **config,
):
    model = tiny_model(model_type, getattr(transformers, family), layerdrop=layerdrop)
    if checkpointing:  # activation recomputation, as Transformers users enable it
        model.gradient_checkpointing_enable({"use_reentrant": False})
    shape = _shape_of(family, model_type)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = _runner(model, opt, stage, **config)
    model.train()
    losses = []
    for step in range(STEPS):
        batch = _batch(model, family, shape, step)
        loss = runner(**{k: v.chunk(world)[rank] for k, v in batch.items()}).loss
        step_and_state(runner, opt, loss)
        losses.append(loss.item())
    return _trained(model, runner, opt, losses, dtypes)


def _runner(model, opt, stage, **config):
    """torch's DDP (`stage` "ddp"), or the engine at `stage` with `config`. DDP finds
    unused parameters: an expert, a vision tower or a layer of another type may get
    nothing on a rank."""
    if stage == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    return ZeroEngine(model, opt, ZeroConfig(stage=stage, **config))


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=[f"{f[12:]}-{n}" for f, n in CASES])
def test_an_architecture_trains_at_stage_3_as_under_ddp(family, model_type):
    _tiny_or_skip(family, model_type)
    (ddp_losses, ddp_state), layerdrop = _ddp_run(family, model_type)
    losses, state = run_world(_train, 2, family, model_type, 3, layerdrop=layerdrop)[0]
    assert losses == ddp_losses, (losses, ddp_losses)
    _assert_holds_exactly(state, ddp_state, "DDP's")


def _tiny_or_skip(family: str, model_type: str) -> torch.nn.Module:
    """The model built tiny, here too, so that the ranks inherit its modules and its
    input's shape; skips with the reason where the rule cannot build it or feed it."""
    model = _built_or_skip(family, model_type)
    if isinstance(shape := _shape_of(family, model_type), str):
        pytest.skip(f"{model_type}: takes none of the inputs the rule makes: {shape}")
    return model


def _built_or_skip(family: str, model_type: str) -> torch.nn.Module:
    """The model built tiny, or a skip that says why the rule cannot build it."""
    try:
        return tiny_model(model_type, getattr(transformers, family))
    except Exception as e:  # any reason it cannot be built tiny
        pytest.skip(f"{model_type}: not built tiny: {type(e).__name__}: {str(e)[:200]}")


def _assert_holds_exactly(state: dict, want: dict, whose: str) -> None:
    """Every tensor of `want` is in `state`, equal to the bit."""
    missing = sorted(set(want) - set(state))
    differ = [n for n, v in want.items() if n in state and not torch.equal(state[n], v)]
    assert not missing, f"not in the engine's state: {missing[:5]}"
    assert not differ, f"{len(differ)} tensors differ from {whose}, first {differ[:5]}"


def _loaded(payload: bytes):
    """A rank's result as `run_world(..., expect_errors=True)` hands it over."""
    return torch.load(io.BytesIO(payload), weights_only=True)


@functools.cache
def _ddp_result(
    family: str, model_type: str, sgd: bool, checkpointing: bool, layerdrop: float
) -> list:
    return run_world(
        _train, 2, family, model_type, "ddp", sgd, checkpointing, layerdrop, expect_errors=True
    )


def _ddp_run(family: str, model_type: str, sgd: bool = False, checkpointing: bool = False):
    """The DDP run's (losses, state) (once per worker), and the LayerDrop it ran with:
    `LAYERDROP`, or none where DDP cannot train the model with it. Skips where DDP
    cannot train it at all."""
    return _first_trained_by_ddp(
        model_type,
        (LAYERDROP, 0.0),
        lambda layerdrop: _ddp_result(family, model_type, sgd, checkpointing, layerdrop),
    )


def _first_trained_by_ddp(model_type: str, options, ddp_with) -> tuple:
    """DDP's (losses, state) with the first of `options` that DDP trains the model with
    (`ddp_with(option)` is `run_world`'s answer), and that option. Skips, with the last
    one's error, where DDP trains it with none."""
    for option in dict.fromkeys(options):
        ddp = ddp_with(option)
        if all(status == "ok" for status, _ in ddp):
            return _loaded(ddp[0][1]), option
    reason = next(payload for status, payload in ddp if status != "ok")
    pytest.skip(f"{model_type}: DDP itself does not train it: {reason.splitlines()[0][:200]}")


MOE_CASES = [("AutoModelForCausalLM", name) for name in sorted(FAMILIES["AutoModelForCausalLM"])]


@pytest.mark.parametrize(("family", "model_type"), MOE_CASES, ids=[n for _, n in MOE_CASES])
def test_an_moe_architecture_trains_expert_parallel_as_under_ddp(family, model_type):
    """Each architecture whose tiny model has experts (4 of them) trains with
    expert_parallel_size=2 at stage 3 as under DDP, within float reordering (each expert's
    tokens arrive by all-to-all, in another order), or, where its experts are in a form
    that cannot be split (Llama 4's, JetMoE's), is refused by name, never left replicated.
    SGD: its weights follow the gradients' scale, which Adam's would hide (and Adam would
    magnify a reordering of a gradient near zero into a step of its own)."""
    model = _tiny_or_skip(family, model_type)
    if not any(type(m).__name__.endswith("Experts") for m in model.modules()):
        pytest.skip(f"{model_type}: no experts")
    (ddp_losses, ddp_state), layerdrop = _ddp_run(family, model_type, sgd=True)
    runs = run_world(
        _train,
        2,
        family,
        model_type,
        3,
        True,
        layerdrop=layerdrop,
        expert_parallel_size=2,
        expect_errors=True,
    )
    if any(status != "ok" for status, _ in runs):
        for status, payload in runs:
            assert status == "error" and "that cannot be split" in payload, payload[:3000]
            assert "expert_parallel_size=1" in payload
        return
    losses, state = _loaded(runs[0][1])
    assert losses == pytest.approx(ddp_losses, rel=1e-5)
    assert state.keys() >= ddp_state.keys()
    for name, value in ddp_state.items():
        torch.testing.assert_close(
            state[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=[f"{f[12:]}-{n}" for f, n in CASES])
def test_an_architecture_with_fp32_marks_keeps_them_in_bf16_at_stage_3_as_at_stage_0(
    family, model_type
):
    """Each architecture whose model marks parameters to stay in fp32 at bf16
    (`_keep_in_fp32_modules_strict`: MoE routers, sinks) trains in bf16 compute at stage 3
    as at stage 0 to the bit, those parameters computing in fp32 and the rest in bf16.
    Stage 0 is the reference: DDP would cast the marked ones with the rest."""
    marked = _fp32_marked_or_skip(_tiny_or_skip(family, model_type), model_type)
    _assert_marks_kept_as_at_stage_0(
        marked,
        model_type,
        lambda stage, layerdrop, **kw: run_world(
            _train, 2, family, model_type, stage, layerdrop=layerdrop, **kw
        ),
        (LAYERDROP, 0.0),
    )


def _fp32_marked_or_skip(model, model_type: str) -> list[str]:
    """The parameters `model` marks to stay in fp32 at bf16, or a skip when none."""
    from zero_strategy.layout.fp32_params import Fp32Parameters, fp32_patterns

    kept = Fp32Parameters(fp32_patterns(model, None, torch.bfloat16))
    marked = [n for n, _ in model.named_parameters() if kept([n])]
    if not marked:
        pytest.skip(f"{model_type}: marks no parameter to stay in fp32 at bf16")
    return marked


def _assert_marks_kept_as_at_stage_0(marked: list[str], model_type: str, run, options) -> None:
    """`run(stage, option, **config)` trains on 2 ranks: in bf16 at stage 3 as at stage 0
    (to the bit), the `marked` parameters in fp32 and the others in bf16, with the first
    of `options` stage 0 trains the model with (`_first_trained_by_ddp`'s rule)."""
    for option in dict.fromkeys(options):
        want = run(0, option, dtypes=True, compute_dtype="bf16", expect_errors=True)
        if all(status == "ok" for status, _ in want):
            break
    else:
        reason = next(payload for status, payload in want if status != "ok")
        pytest.skip(f"{model_type}: does not train in bf16 at stage 0: {reason.splitlines()[0]}")
    want_losses, want_state, want_dtypes = _loaded(want[0][1])
    losses, state, dtypes = run(3, option, dtypes=True, compute_dtype="bf16")[0]
    assert losses == want_losses, (losses, want_losses)
    _assert_holds_exactly(state, want_state, "stage 0's")
    assert dtypes == want_dtypes
    assert {n: dtypes[n] for n in marked} == dict.fromkeys(marked, "torch.float32")
    assert set(dtypes.values()) == {"torch.float32", "torch.bfloat16"}


def _candidate_shapes(model) -> list[tuple[int, ...]]:
    """Shapes of the whole batch's main input (`model.main_input_name`) to try, in order:
    token ids; an image at the config's size; a waveform; a spectrogram, frames first or
    last (Whisper's encoder asks for twice its positions)."""
    config, name = model.config, model.main_input_name
    if name == "input_ids":
        return [(BATCH, SEQ)]
    if name == "pixel_values":
        size = setting(config, "image_size") or 64  # a convolutional network's: any
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return [(BATCH, setting(config, "num_channels") or 3, height, width)]
    bins = setting(config, "num_mel_bins") or setting(config, "feature_size") or 80
    frames = 2 * (setting(config, "max_source_positions") or 32)
    spectrograms = [(BATCH, frames, bins), (BATCH, bins, frames)]
    return [(BATCH, 4000), *spectrograms] if name == "input_values" else spectrograms


@functools.cache
def _shape_of(family: str, model_type: str) -> tuple[int, ...] | str:
    """The first candidate shape (`_candidate_shapes`) the model takes in a forward, or
    why it takes none."""
    model = tiny_model(model_type, getattr(transformers, family)).eval()
    candidates = _candidate_shapes(model)
    if len(candidates) == 1:  # token ids, an image: nothing to choose (a decoder asks
        return candidates[0]  # for the labels' decoder inputs besides)
    kind = torch.long if model.main_input_name == "input_ids" else torch.float
    why = "no candidate"
    for shape in candidates:
        try:
            with torch.no_grad():
                model(**{model.main_input_name: torch.ones(shape, dtype=kind)})
            return shape
        except Exception as e:  # another layout, or no input it takes
            why = f"{type(e).__name__}: {str(e)[:200]}"
    return why


def _batch(model, family: str, shape, step: int) -> dict[str, torch.Tensor]:
    """The whole batch of one step (each rank takes its slice): the main input of `shape`
    and the family's labels (the ids themselves for a language model)."""
    g = torch.Generator().manual_seed(step)
    if model.main_input_name == "input_ids":
        main = torch.randint(1, _vocabulary(model), shape, generator=g)
    else:
        main = torch.randn(shape, generator=g)
    if family in ONE_LABEL:
        labels = torch.randint(0, model.config.num_labels, (BATCH,), generator=g)
    elif family == "AutoModelForCTC":  # a short transcript, no blank (id 0)
        labels = torch.randint(1, setting(model.config, "vocab_size"), (BATCH, 4), generator=g)
    else:
        labels = main
    return {model.main_input_name: main, "labels": labels}


def _vocabulary(model) -> int:
    """Token ids every embedding and head of the model takes."""
    sizes = [model.get_input_embeddings().num_embeddings, model.config.get_text_config().vocab_size]
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        sizes.append(head.out_features)
    return min(sizes)


@pytest.mark.parametrize(("family", "model_type"), CASES, ids=[f"{f[12:]}-{n}" for f, n in CASES])
def test_an_architecture_with_gradient_checkpointing_trains_as_under_ddp(family, model_type):
    """Transformers' gradient checkpointing (non-reentrant, as its docs advise): each
    recomputed forward inside backward gathers its units again at stage 3, and the run
    equals DDP's with the same checkpointing, to the bit. (Against DDP without it, a
    model whose checkpointed forward takes another path would differ on its own.)"""
    model = _tiny_or_skip(family, model_type)
    if not model.supports_gradient_checkpointing:
        pytest.skip(f"{model_type}: Transformers does not support gradient checkpointing for it")
    (ddp_losses, ddp_state), layerdrop = _ddp_run(family, model_type, checkpointing=True)
    runs = run_world(_train, 2, family, model_type, 3, checkpointing=True, layerdrop=layerdrop)
    losses, state = runs[0]
    assert losses == ddp_losses, (losses, ddp_losses)
    _assert_holds_exactly(state, ddp_state, "DDP's")


TENSOR_PARALLEL_CASES = sorted(FAMILIES["AutoModelForCausalLM"])


def _train_tensor_parallel(rank, world, model_type, path, engine: bool, experts: bool):
    """The tiny model loaded with Transformers' own plan over the `world` ranks
    (`tp_plan="auto"`; with `experts`, its expert-parallel plan too: each rank holds half
    the experts, `DistributedConfig(tp_size=2, ep_size=2)`), trained on the whole batch
    (every rank the same: one data-parallel rank), by the engine told
    `tensor_parallel_size`, or by the optimizer alone."""
    from transformers.distributed import DistributedConfig

    family = "AutoModelForCausalLM"
    plans = DistributedConfig(tp_size=world, ep_size=world if experts else None, tp_plan="auto")
    model = getattr(transformers, family).from_pretrained(
        path, distributed_config=plans, dtype=torch.float32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(stage=3, tensor_parallel_size=world)
    runner = ZeroEngine(model, opt, config) if engine else model
    model.train()
    losses = []
    for step in range(STEPS):
        loss = runner(**_batch(model, family, _shape_of(family, model_type), step)).loss
        if engine:
            runner.backward(loss)
            runner.step()
            runner.zero_grad()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    if engine:
        state = runner.full_state_dict(rank0_only=False)
        runner.close()
    else:
        state = {k: _whole(v) for k, v in model.state_dict().items()}
    return losses, state


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


@pytest.mark.parametrize("plans", ["tp", "tp+ep"])
@pytest.mark.parametrize("model_type", TENSOR_PARALLEL_CASES)
def test_an_architecture_with_a_tensor_parallel_plan_trains_as_without_the_engine(
    model_type, plans, tmp_path
):
    """Each causal LM whose config ships a tensor-parallel plan (`base_model_tp_plan`),
    loaded with it over 2 ranks (`tp+ep`: an MoE model's expert-parallel plan too,
    `base_model_ep_plan`): the engine, told `tensor_parallel_size=2`, trains it as the
    optimizer alone trains the same loaded model, losses and final state to the bit.
    Skipped where Transformers' own plans do not load or train it tiny."""
    family = "AutoModelForCausalLM"
    model = _tiny_or_skip(family, model_type)
    text = model.config.get_text_config()
    if not (getattr(text, "base_model_tp_plan", None) or {}):
        pytest.skip(f"{model_type}: its config ships no tensor-parallel plan")
    experts = plans == "tp+ep"
    if experts and not (getattr(text, "base_model_ep_plan", None) or {}):
        pytest.skip(f"{model_type}: its config ships no expert-parallel plan")
    try:
        model.save_pretrained(tmp_path)
    except Exception as e:  # Transformers' own round trip, before this engine
        pytest.skip(f"{model_type}: not saved tiny: {type(e).__name__}: {str(e)[:200]}")
    path = str(tmp_path)
    reference = run_world(
        _train_tensor_parallel, 2, model_type, path, False, experts, expect_errors=True
    )
    if any(status != "ok" for status, _ in reference):
        reason = next(payload for status, payload in reference if status != "ok")
        pytest.skip(f"{model_type}: Transformers' plans do not train it: {_last_line(reason)}")
    want_losses, want_state = _loaded(reference[0][1])
    losses, state = run_world(_train_tensor_parallel, 2, model_type, path, True, experts)[0]
    assert losses == want_losses, (losses, want_losses)
    _assert_holds_exactly(state, want_state, "the optimizer alone's")


def _last_line(traceback: str) -> str:
    """The error of a rank's traceback (its last line), shortened."""
    lines = [line for line in traceback.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


@pytest.mark.parametrize(
    ("family", "model_type"), LOAD_CASES, ids=[f"{f[12:]}-{n}" for f, n in LOAD_CASES]
)
def test_an_architecture_loads_pretrained_weights_by_shards(family, model_type, tmp_path):
    """The fine-tuning path (docs/fine_tuning.md): built on the meta device, sharded at
    stage 3, each rank reading its own ranges of what `save_pretrained` wrote (several
    shards); the model holds what `from_pretrained` gives, to the bit."""
    try:
        want = saved_tiny(family, model_type, tmp_path)
    except Exception as e:  # Transformers' own round trip, before this engine
        pytest.skip(f"{model_type}: not saved and loaded tiny: {type(e).__name__}: {str(e)[:200]}")
    (status, payload), _ = run_world(
        load_by_shards, 2, family, model_type, str(tmp_path), expect_errors=True
    )
    assert status == "ok", payload[:3000]
    _assert_holds_exactly(_loaded(payload), want, "from_pretrained's")


# Which ranks see an image, step by step: both; rank 0 alone (rank 1's vision tower sits
# idle, the path on which ZeRO-3 elsewhere hangs); neither (no gradient for the tower).
IMAGES_BY_STEP = ((True, True), (True, False), (False, False))


def _train_vision_language(
    rank, world, model_type, stage, images_by_step, mode="", dtypes=False, **config
):
    model = tiny_model(model_type, getattr(transformers, VISION_LANGUAGE))
    inputs = VisionLanguageInputs(model)
    if mode == "checkpointing":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    elif mode == "frozen tower":  # the usual fine-tuning recipe: only the language side
        for param in inputs.image_only_parameters(model):
            param.requires_grad_(False)
    elif mode == "lora":  # PEFT's adapters on every linear layer, the towers' too
        model = with_lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    runner = _runner(model, opt, stage, **config)
    model.train()
    losses = []
    for step, images in enumerate(images_by_step):
        g = torch.Generator().manual_seed(100 * step + rank)
        batch = inputs.collate([inputs.sample(g, images[rank]) for _ in range(BATCH // world)])
        loss = runner(**batch).loss
        step_and_state(runner, opt, loss)
        losses.append(loss.item())
    return _trained(model, runner, opt, losses, dtypes)


def _trained(model, runner, opt, losses, dtypes: bool) -> tuple:
    """A run's losses and final state, with `dtypes` what each parameter computes in (a
    freed stage-3 parameter reads its unit's)."""
    state = step_and_state(runner, opt, finish=True)
    if dtypes:
        return losses, state, {n: str(p.dtype) for n, p in model.named_parameters()}
    return losses, state


@functools.cache
def _vision_language_ddp(model_type: str, mode: str):
    """DDP's (losses, state) and the images it trained with: `IMAGES_BY_STEP`, or an
    image on every rank at every step where the model cannot take a text-only batch.
    Skips where DDP cannot train it at all."""
    return _first_trained_by_ddp(
        model_type,
        (IMAGES_BY_STEP, ((True, True),) * len(IMAGES_BY_STEP)),
        lambda images: run_world(
            _train_vision_language, 2, model_type, "ddp", images, mode, expect_errors=True
        ),
    )


def _vision_language_or_skip(model_type: str, mode: str) -> torch.nn.Module:
    """The tiny vision-language model, or a skip that says why the rule cannot build it,
    feed it, or tell its vision tower (`mode` "frozen tower")."""
    model = _built_or_skip(VISION_LANGUAGE, model_type)
    try:
        inputs = VisionLanguageInputs(model)
        if mode == "frozen tower":
            inputs.image_only_parameters(model)
    except ValueError as e:
        pytest.skip(f"{model_type}: not fed by the rule ({mode or 'trained'}): {str(e)[:300]}")
    return model


@pytest.mark.parametrize("mode", ["", "checkpointing", "frozen tower", "lora"])
@pytest.mark.parametrize("model_type", VISION_LANGUAGE_CASES)
def test_a_vision_language_model_trains_at_stage_3_as_under_ddp(model_type, mode):
    """Images on both ranks, then on one, then on neither: at stage 3 each step equals
    DDP's to the bit (losses, and every tensor of the full state); with Transformers'
    gradient checkpointing; with the parameters only an image reaches (the vision tower,
    its projector; where the text attends to the image, Mllama's and IDEFICS's
    cross-attention layers too) frozen, as fine-tuning recipes do; with PEFT's LoRA
    adapters on every linear layer. The rank without an image never runs the tower, so
    the ranks' forwards differ; where the model cannot take a text-only batch, both see
    images on every step."""
    model = _vision_language_or_skip(model_type, mode)
    if mode == "checkpointing" and not model.supports_gradient_checkpointing:
        pytest.skip(f"{model_type}: Transformers does not support gradient checkpointing for it")
    if mode == "lora":
        pytest.importorskip("peft")
    (ddp_losses, ddp_state), images = _vision_language_ddp(model_type, mode)
    runs = run_world(_train_vision_language, 2, model_type, 3, images, mode)
    losses, state = runs[0]
    assert losses == ddp_losses, (losses, ddp_losses)
    _assert_holds_exactly(state, ddp_state, "DDP's")


@pytest.mark.parametrize("model_type", VISION_LANGUAGE_CASES)
def test_a_vision_language_model_with_fp32_marks_keeps_them_in_bf16_at_stage_3(model_type):
    """As the language models above: images on both ranks, then one, then neither (or,
    where the model cannot take a text-only batch, on both at every step)."""
    marked = _fp32_marked_or_skip(_vision_language_or_skip(model_type, ""), model_type)
    _assert_marks_kept_as_at_stage_0(
        marked,
        model_type,
        lambda stage, images, **kw: run_world(
            _train_vision_language, 2, model_type, stage, images, **kw
        ),
        (IMAGES_BY_STEP, ((True, True),) * len(IMAGES_BY_STEP)),
    )
