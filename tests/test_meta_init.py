"""A model built on the meta device is materialised one unit at a time: no rank ever holds
its full size."""

from __future__ import annotations

import ctypes

import pytest
import torch

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from training import make_optimizer
from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta

_M_MMAP_THRESHOLD = -3
BIG = GPTConfig(vocab_size=4096, block_size=64, n_layer=16, n_head=8, n_embd=512)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build(rank: int, world: int, on_meta: bool):
    # Make RSS follow allocations: large blocks are mmapped and returned to the system on
    # free, instead of staying in glibc's heap (whose dynamic threshold would otherwise
    # keep freed unit buffers resident and measure the allocator, not the engine).
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    with init_on_meta():  # the first meta context imports modules: not model memory
        GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4))
    _reset_peak_rss()
    base = _proc_status("VmRSS")
    torch.manual_seed(0)
    if on_meta:
        with init_on_meta():
            model = GPT(BIG)
    else:
        model = GPT(BIG)
    full_bytes = 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    peak = _proc_status("VmHWM") - base
    held = engine.memory_report()
    largest_unit = 4 * max(u.layout.padded_numel for u in engine.units)
    state = engine.full_state_dict()
    # The materialised model trains.
    x = torch.randint(BIG.vocab_size, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    return dict(
        full=full_bytes,
        peak=peak,
        params=held["parameters"],
        held=held["total"],
        largest_unit=largest_unit,
        state={
            k: v
            for k, v in state.items()
            if k in ("wte.weight", "blocks.3.fc.weight", "ln_f.weight")
        },
    )


def test_meta_init_never_allocates_the_full_model():
    results = run_world(_build, 2, True, timeout=300)
    for r in results:
        assert r["params"] <= r["full"] / 2 + 4 * 64  # one shard, up to padding
        # Beyond what the engine keeps (parameter and gradient shards), construction
        # needed one unit's full buffer and its broadcast at a time, never the model.
        transient = r["peak"] - r["held"]
        assert transient < 2 * r["largest_unit"] + (16 << 20), (transient, r["largest_unit"])
        assert transient < r["full"] / 4
    # Initialised by the model's own _init_weights (std 0.02 normal, LayerNorm ones) ...
    state = results[0]["state"]
    assert abs(state["wte.weight"].std().item() - 0.02) < 1e-3
    assert torch.equal(state["ln_f.weight"], torch.ones_like(state["ln_f.weight"]))


def test_eager_construction_does_hold_the_full_model_for_contrast():
    r = run_world(_build, 2, False, timeout=300)[0]
    assert r["peak"] >= r["full"]


class _WithBuffers(torch.nn.Module):
    """A model with its own `_init_weights`, as Hugging Face models have, that recomputes
    one of its two parameter-free buffers (as they recompute rotary frequencies); the
    other is persistent, or not."""

    def __init__(self, fill_both: bool, persistent: bool = True):
        super().__init__()
        self.fill_both = fill_both
        self.linear = torch.nn.Linear(4, 4)
        self.rotary = torch.nn.Module()
        self.rotary.register_buffer("inv_freq", torch.arange(4.0))
        self.rotary.register_buffer("steps", torch.arange(4), persistent=persistent)

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
        if module is self.rotary:
            module.inv_freq.copy_(torch.arange(4.0))
            if self.fill_both:
                module.steps.copy_(torch.arange(4))

    def forward(self, x):
        return self.linear(x) * self.rotary.inv_freq + self.rotary.steps


def test_meta_buffers_are_recomputed_by_the_models_init_or_named():
    """A model built under torch.device("meta") has meta buffers: its initialiser
    recomputes them, or the engine names those it left: at construction where no
    checkpoint carries them (non-persistent ones)."""
    with torch.device("meta"):
        model = _WithBuffers(fill_both=True)
    ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(model.rotary.inv_freq, torch.arange(4.0))
    assert torch.equal(model.rotary.steps, torch.arange(4))
    with torch.device("meta"):
        model = _WithBuffers(fill_both=False, persistent=False)
    with pytest.raises(ValueError, match=r"\['rotary.steps'\].*did not fill them"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_persistent_buffer_no_initialiser_fills_waits_for_the_load(tmp_path):
    """Apertus's activation constants: made in `__init__`, recomputed by no initialiser,
    carried by every checkpoint, as `from_pretrained` loads them. On the meta device the
    engine builds the model and lets `load_pretrained` fill them; the first forward
    without that names them and the fix, instead of computing with placeholders."""
    import safetensors.torch

    want = _WithBuffers(fill_both=True)
    with torch.device("meta"):
        model = _WithBuffers(fill_both=False)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"\['rotary.steps'\].*load_pretrained"):
        engine(torch.ones(2, 4))
    safetensors.torch.save_file(want.state_dict(), tmp_path / "model.safetensors")
    engine.load_pretrained(tmp_path / "model.safetensors")
    assert torch.equal(model.rotary.steps, torch.arange(4))
    assert torch.equal(engine(torch.ones(2, 4)), want(torch.ones(2, 4)))
    engine.close()


class _WithMask(torch.nn.Module):
    """As GPT-Neo's attention: a boolean causal mask its initialiser computes again."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril(), persistent=False)

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
        if module is self:
            module.mask.copy_(torch.ones(4, 4, dtype=torch.bool).tril())


def test_a_boolean_mask_built_on_meta_is_made_by_the_initialiser():
    """A boolean buffer has no sentinel to tell it unfilled: it is made real and left to
    the model's initialiser, as `from_pretrained` leaves it (it was refused before)."""
    with init_on_meta():
        model = _WithMask()
    ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(model.mask, torch.ones(4, 4, dtype=torch.bool).tril())


def _meta_built(rank, world, wrapped: bool):
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    with init_on_meta():
        model = GPT(cfg)
        if wrapped:  # as a LightningModule's configure_model holds it
            holder = torch.nn.Module()
            holder.model = model
            model = holder
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    state = {k.removeprefix("model."): v for k, v in engine.full_state_dict().items()}
    engine.close()
    return state


def test_a_model_inside_another_module_gets_its_own_initialisation():
    """The GPT's `_init_weights` (GPT-2's normal(0, 0.02)) initialises it on the meta
    device whether it is the root or held by another module (a LightningModule); before,
    only the root's was looked for, and a held model got its layers' kaiming defaults."""
    bare = run_world(_meta_built, 2, False)[0]
    held = run_world(_meta_built, 2, True)[0]
    assert set(bare) == set(held)
    for name, value in bare.items():
        assert torch.equal(held[name], value), name
    assert abs(held["lm_head.weight"].std().item() - 0.02) < 0.003


class _Embeddings(torch.nn.Module):
    """As SigLIP's vision embeddings: a buffer of its own, a child's weight."""

    def __init__(self):
        super().__init__()
        self.position = torch.nn.Embedding(8, 4)
        self.register_buffer("ids", torch.arange(8), persistent=False)


class _EmbeddingsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = _Embeddings()
        self.head = torch.nn.Linear(4, 4)

    def _init_weights(self, module):  # as SigLIP's: the embeddings' init fills both
        if isinstance(module, _Embeddings):
            module.ids.copy_(torch.arange(8))
            torch.nn.init.normal_(module.position.weight)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight)
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()


def _embeddings_built(rank, world, stage):
    with init_on_meta():
        model = _EmbeddingsModel()
    torch.manual_seed(rank)  # each rank's own generator, as in a launch without a seed
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": stage})
    state = engine.full_state_dict(rank0_only=False)
    with engine.gathered_parameters():  # what the forward computes with
        live = model.embeddings.position.weight.detach().clone()
    ids = model.embeddings.ids.clone()
    engine.close()
    return state, live, ids


@pytest.mark.parametrize("stage", [1, 3])
def test_a_buffer_owners_initialiser_leaves_its_childrens_parameters_as_agreed(stage):
    """The initialiser run for a module's buffers (SigLIP's `_init_weights` of its vision
    embeddings) also draws its child's weight. It runs after every parameter was
    initialised and agreed over the ranks, so the parameters are set aside while it runs:
    before, at stage 1 each rank drew the weight again from its own generator and the
    replicas differed; at stage 3 the released weight refused the write."""
    (state0, live0, ids0), (state1, live1, ids1) = run_world(_embeddings_built, 2, stage)
    assert torch.equal(ids0, torch.arange(8)) and torch.equal(ids1, torch.arange(8))
    assert torch.equal(live0, state0["embeddings.position.weight"])
    assert torch.equal(live1, live0)
    assert (
        state0.keys() == state1.keys() == {"embeddings.position.weight", "head.weight", "head.bias"}
    )
    for name, value in state0.items():
        assert torch.equal(state1[name], value), name
