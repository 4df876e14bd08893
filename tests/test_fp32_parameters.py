"""Parameters kept in fp32 under bf16/fp16 compute (`ZeroConfig.fp32_parameters`, or the
model's own Transformers marks `_keep_in_fp32_modules_strict` / `_keep_in_fp32_modules`):
their buckets (stages 0-2) or units (stage 3) are fp32 ones, so the forward sees them
exactly as their fp32 masters hold them, and every stage trains them alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import preload, run_world
from zero_strategy import ZeroConfig, ZeroEngine

STEPS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.router = nn.Linear(16, 4, bias=False)
        self.seen: set[tuple[str, torch.dtype]] = set()

    def forward(self, x):
        self.seen |= {("fc", self.fc.weight.dtype), ("router", self.router.weight.dtype)}
        gate = F.linear(x.float(), self.router.weight.float()).softmax(-1)
        return torch.tanh(self.fc(x)) * gate.sum(-1, keepdim=True).to(x.dtype)


class Model(nn.Module):
    """Routers inside the blocks (stage 3's units), a head outside them, a parameter of
    the root itself; block 0's fc frozen, block 1's router frozen."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(()))
        self.blocks[0].fc.requires_grad_(False)
        self.blocks[1].router.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = x.to(self.head.weight.dtype)  # as Transformers' T5 reads its kept `wo`
        return (self.head(x).float() * self.scale.float()).pow(2).mean()


KEPT = ["router", "head"]


def _train(rank, world, patterns):
    """Each stage in turn, in bf16 compute: the losses, the dtypes each forward saw, and
    whether each parameter's compute copy equals its fp32 master (exactly, or rounded)."""
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = Model()
        trained = [p for p in model.parameters() if p.requires_grad]
        config = ZeroConfig(stage=stage, compute_dtype="bf16", fp32_parameters=patterns)
        engine = ZeroEngine(model, torch.optim.Adam(trained, lr=1e-2), config)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(STEPS):
            loss = engine(torch.randn(4, 16, generator=g).bfloat16())
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        masters = engine.full_state_dict(rank0_only=False)
        computed = engine.module.state_dict()
        copies = {
            name: (str(computed[name].dtype), torch.equal(computed[name].float(), masters[name]))
            for name in ("blocks.0.router.weight", "blocks.0.fc.weight", "head.weight", "scale")
        }
        seen = sorted((kind, str(dtype)) for kind, dtype in model.blocks[2].seen)
        out[stage] = losses, seen, copies
        engine.close()
    return out


def _root_parameter(rank, world):
    """Stage 3's root unit holds one dtype: a kept parameter of the root module itself
    stays in the compute dtype, with a warning that says so and how to change it."""
    model = Model()
    config = ZeroConfig(stage=3, compute_dtype="bf16", fp32_parameters=["scale"])
    trained = [p for p in model.parameters() if p.requires_grad]
    with pytest.warns(UserWarning, match=r"\['scale'\] should compute in fp32 but belong to"):
        engine = ZeroEngine(model, torch.optim.SGD(trained, lr=0.1), config)
    dtype = model.scale.dtype
    engine.close()
    return str(dtype)


def test_a_kept_parameter_of_the_root_module_stays_in_bf16_at_stage_3_with_a_warning():
    assert run_world(_root_parameter, 2) == ["torch.bfloat16"] * 2


def test_kept_parameters_compute_in_fp32_and_every_stage_trains_alike():
    kept, plain = (run_world(_train, 2, patterns)[0] for patterns in (KEPT, []))
    for stage in (1, 2, 3):
        assert kept[stage][0] == kept[0][0]  # the losses, to the bit
        assert plain[stage][0] == plain[0][0]
    for _, seen, copies in kept.values():
        assert seen == [("fc", "torch.bfloat16"), ("router", "torch.float32")]
        assert copies["blocks.0.router.weight"] == ("torch.float32", True)  # the master
        assert copies["head.weight"] == ("torch.float32", True)
        assert copies["blocks.0.fc.weight"][0] == "torch.bfloat16"
    for _, seen, copies in plain.values():
        assert seen == [("fc", "torch.bfloat16"), ("router", "torch.bfloat16")]
        assert copies["blocks.0.router.weight"] == ("torch.bfloat16", False)  # rounded
    assert kept[0][0] != plain[0][0]  # the fp32 routers train differently


def test_a_pattern_that_names_no_parameter_is_refused():
    model = Model()
    config = ZeroConfig(stage=2, compute_dtype="bf16", fp32_parameters=["routr"])
    with pytest.raises(ValueError, match=r"fp32_parameters has \['routr'\], which no parameter"):
        ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def test_fp32_compute_ignores_the_patterns():
    model = Model()
    config = ZeroConfig(stage=2, fp32_parameters=["routr"])  # fp32: nothing to keep
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert {u.compute_dtype for u in engine.units} == {torch.float32}
    engine.close()


preload("zero_strategy.integrations.transformers", "lightning")


def _deepseek(rank, world):
    """DeepSeek-V3 marks its routers' weights `_keep_in_fp32_modules_strict`: in bf16 they
    compute in fp32 with no option given, experts over 2 ranks at stages 2 and 3, and
    `fp32_parameters=[]` turns that off."""
    from test_hf_moe import build, train_on_batches

    out = {}
    for stage, patterns in ((2, None), (3, None), (3, [])):
        model = build("deepseek_v3")
        seen: set[str] = set()

        def note(module, args, seen=seen):
            seen.add(str(module.weight.dtype))

        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_pre_hook(note)
        config = ZeroConfig(
            stage=stage, compute_dtype="bf16", expert_parallel_size=2, fp32_parameters=patterns
        )
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        losses = train_on_batches(engine, engine, rank, world)
        out[stage, patterns is None] = losses, sorted(seen)
        engine.close()
    return out


def test_transformers_marks_keep_deepseek_routers_in_fp32():
    pytest.importorskip("transformers")
    runs = run_world(_deepseek, 2)[0]
    assert runs[2, True][1] == runs[3, True][1] == ["torch.float32"]
    assert runs[3, False][1] == ["torch.bfloat16"]
    assert runs[3, True][0] == runs[2, True][0]  # stage 3 equals stage 2, to the bit
    assert runs[3, True][0] != runs[3, False][0]


class Marked(nn.Module):
    """A model that marks its routers and a buffer as Transformers models do."""

    _keep_in_fp32_modules_strict = ["router", "router_bias"]

    def __init__(self):
        super().__init__()
        self.inner = Model()
        self.register_buffer("router_bias", torch.zeros(4))
        self.register_buffer("other", torch.zeros(4))

    def forward(self, x):
        return self.inner(x) + (self.router_bias.float().sum() + self.other.float().sum())


def _lightning(rank, world):
    """Lightning's "bf16-true": the marks of a model inside the LightningModule apply,
    to its parameters and to the floating buffers the strategy converts."""
    import lightning as L
    from lightning_helpers import quiet_trainer
    from torch.utils.data import DataLoader

    seen = []

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Marked()

        def training_step(self, batch, batch_idx):
            inner = self.model.inner
            seen.append(
                (
                    str(inner.blocks[2].router.weight.dtype),
                    str(inner.blocks[2].fc.weight.dtype),
                    str(self.model.router_bias.dtype),
                    str(self.model.other.dtype),
                )
            )
            return self.model(batch)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    data = DataLoader(torch.randn(8, 16), batch_size=2)
    trainer = quiet_trainer(world, "zero3", max_steps=2, precision="bf16-true")
    trainer.fit(Lit(), data)
    return sorted(set(seen))


def test_lightning_true_precision_keeps_the_marked_parameters_and_buffers_in_fp32():
    pytest.importorskip("lightning")
    want = [("torch.float32", "torch.bfloat16", "torch.float32", "torch.bfloat16")]
    assert run_world(_lightning, 2) == [want, want]


def _resume(rank, world, directory):
    """Stage 3 with kept routers saves after 2 steps and goes on; a stage-1 engine loads
    that checkpoint and takes the same steps."""
    batches = [
        torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * i + rank)) for i in range(4)
    ]

    def engine_at(stage):
        torch.manual_seed(0)
        model = Model()
        trained = [p for p in model.parameters() if p.requires_grad]
        config = ZeroConfig(stage=stage, compute_dtype="bf16", fp32_parameters=KEPT)
        return ZeroEngine(model, torch.optim.Adam(trained, lr=1e-2), config)

    def steps(engine, xs):
        out = []
        for x in xs:
            loss = engine(x.bfloat16())
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            out.append(loss.item())
        return out

    first = engine_at(3)
    steps(first, batches[:2])
    first.save_checkpoint(directory)
    uninterrupted = steps(first, batches[2:])
    first.close()
    resumed = engine_at(1)
    resumed.load_checkpoint(directory)
    after = steps(resumed, batches[2:])
    router = str(resumed.module.blocks[0].router.weight.dtype)
    resumed.close()
    return uninterrupted, after, router


def test_a_stage_3_checkpoint_with_kept_parameters_resumes_at_stage_1(tmp_path):
    for uninterrupted, after, router in run_world(_resume, 2, str(tmp_path / "ckpt")):
        assert after == uninterrupted
        assert router == "torch.float32"


def _load_in_bf16(rank, world, path):
    import transformers

    import zero_strategy
    from tiny_configs import tiny_model

    with zero_strategy.init_on_meta():
        model = tiny_model("deepseek_v3", transformers.AutoModelForCausalLM)
    config = ZeroConfig(stage=3, compute_dtype="bf16")
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.load_pretrained(path)
    state = model.state_dict()  # gathered unit by unit, in each unit's dtype
    engine.close()
    return state


def test_pretrained_weights_load_at_bf16_as_from_pretrained_gives_them(tmp_path):
    """The fine-tuning path: DeepSeek-V3 built on meta, sharded at stage 3 in bf16 and
    loaded by shards holds what `from_pretrained(dtype=bfloat16)` gives, dtypes and all
    (its routers in fp32), to the bit."""
    transformers = pytest.importorskip("transformers")
    from tiny_configs import tiny_model

    tiny_model("deepseek_v3", transformers.AutoModelForCausalLM).save_pretrained(
        tmp_path, max_shard_size="200KB"
    )
    auto = transformers.AutoModelForCausalLM
    want = auto.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert {str(v.dtype) for k, v in want.items() if k.endswith("gate.weight")} == {"torch.float32"}
    for got in run_world(_load_in_bf16, 2, str(tmp_path)):
        assert sorted(got) == sorted(want)
        assert [k for k in want if got[k].dtype != want[k].dtype] == []
        assert [k for k in want if not torch.equal(got[k], want[k])] == []


def _reduced_bytes(rank, world, reduce_dtype):
    torch.manual_seed(0)
    model = Model()
    trained = [p for p in model.parameters() if p.requires_grad]
    config = ZeroConfig(
        stage=1, compute_dtype="bf16", fp32_parameters=KEPT, reduce_dtype=reduce_dtype
    )
    engine = ZeroEngine(model, torch.optim.SGD(trained, lr=0.1), config)
    engine.reset_comm_report()
    engine.backward(engine(torch.randn(4, 16).bfloat16()))
    sent = engine.comm_report()["all_reduce"]["bytes"]
    by_dtype: dict[str, int] = {}
    for unit in engine.units:
        if unit.layout.trainable:
            dtype = str(unit.compute_dtype)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + unit.layout.padded_numel
    engine.close()
    return sent, by_dtype


def test_kept_parameters_reduce_in_fp32_unless_a_reduce_dtype_is_set():
    """Their gradients are computed in fp32 and reduced so (FSDP2's per-module policy
    would too); `reduce_dtype` set reduces every gradient in it."""
    (sent, numel), _ = run_world(_reduced_bytes, 2, None)
    assert sent == 4 * numel["torch.float32"] + 2 * numel["torch.bfloat16"]
    (sent, numel), _ = run_world(_reduced_bytes, 2, "bf16")
    assert sent == 2 * (numel["torch.float32"] + numel["torch.bfloat16"])


def _quantized(rank, world):
    torch.manual_seed(0)
    model = Model()
    trained = [p for p in model.parameters() if p.requires_grad]
    config = ZeroConfig(
        stage=3,
        compute_dtype="bf16",
        fp32_parameters=KEPT,
        quantized_weights=True,
        quantized_gradients=True,
    )
    engine = ZeroEngine(model, torch.optim.Adam(trained, lr=1e-2), config)
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
        engine.backward(engine(x))
        engine.step()
        engine.zero_grad()
    seen = {}
    hook = model.blocks[2].register_forward_pre_hook(  # after the engine's gather
        lambda m, args: seen.update(router=m.router.weight.detach().clone())
    )
    with torch.no_grad():
        engine(torch.randn(4, 16).bfloat16())
    hook.remove()
    masters = engine.full_state_dict(rank0_only=False)
    engine.close()
    return torch.equal(seen["router"], masters["blocks.2.router.weight"])


def test_kept_parameters_are_gathered_whole_under_quantized_weights():
    """ZeRO++'s int8 gathers and reductions leave kept parameters out: the forward sees
    the router's master to the bit."""
    assert run_world(_quantized, 2) == [True, True]


def test_converting_kept_parameters_after_the_hand_over_is_named_with_their_dtype():
    """`model.to(torch.bfloat16)` after the engine took the model reaches the kept
    parameters too: the refusal names them and the dtype the engine holds them in."""
    model = Model()
    trained = [p for p in model.parameters() if p.requires_grad]
    config = ZeroConfig(stage=2, compute_dtype="bf16", fp32_parameters=["router"])
    engine = ZeroEngine(model, torch.optim.SGD(trained, lr=0.1), config)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'blocks.0.router.weight'\].*engine's torch.float32"):
        engine(torch.randn(4, 16).bfloat16())
    engine.close()


def _peft_model(path: str, autocast: bool):
    """DeepSeek-V3 as `from_pretrained(dtype=bfloat16)` loads it (routers fp32), with LoRA
    on every linear layer (its routers too; PEFT keeps the adapters fp32 unless told not
    to: `autocast_adapter_dtype`), B drawn at random (PEFT starts it at zero)."""
    import transformers

    from training import with_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(0)  # LoRA's A is drawn at random
    return with_lora(model, autocast_adapter_dtype=autocast)


def _dtypes(model) -> dict[str, list[str]]:
    kinds = {"router": "gate.base_layer.weight", "adapter": "lora_A.default.weight"}
    kinds["base"] = "q_proj.base_layer.weight"
    return {
        kind: sorted({str(p.dtype) for n, p in model.named_parameters() if n.endswith(end)})
        for kind, end in kinds.items()
    }


def _peft_deepseek(rank, world, path, autocast):
    from test_hf_moe import train_on_batches

    out = {}
    for stage in (0, 3):
        model = _peft_model(path, autocast)
        trained = [p for p in model.parameters() if p.requires_grad]
        config = ZeroConfig(stage=stage, compute_dtype="bf16")
        engine = ZeroEngine(model, torch.optim.AdamW(trained, lr=1e-2), config)
        losses = train_on_batches(engine, engine, rank, world)
        out[stage] = losses, _dtypes(model)
        engine.close()
    return out


@pytest.mark.parametrize("autocast", [True, False], ids=["adapters-fp32", "adapters-bf16"])
def test_peft_adapters_and_a_wrapped_router_keep_their_dtypes_as_peft_and_transformers_do(
    tmp_path, autocast
):
    """LoRA on every linear layer of DeepSeek-V3 in bf16: the adapters compute in fp32, as
    PEFT keeps them over a bf16 base, or each in its layer's dtype where the user told
    PEFT not to cast them (`autocast_adapter_dtype=False`); the routers in fp32, though wrapped (their weights
    named `gate.base_layer.weight` where the mark says `gate.weight`). Stage 3 equals
    stage 0 to the bit, and both equal one process training the same model."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from test_hf_moe import PER_RANK, build, global_batches

    build("deepseek_v3").save_pretrained(tmp_path)
    runs = run_world(_peft_deepseek, 2, str(tmp_path), autocast)[0]
    # Without the cast, PEFT makes each adapter in its layer's dtype: the routers' fp32.
    adapter = ["torch.float32"] if autocast else ["torch.bfloat16", "torch.float32"]
    want = {"router": ["torch.float32"], "adapter": adapter, "base": ["torch.bfloat16"]}
    assert runs[0][1] == runs[3][1] == want
    assert runs[3][0] == runs[0][0]
    model = _peft_model(str(tmp_path), autocast)
    assert _dtypes(model) == want
    # One process, with fp32 masters as the engine keeps them (a bf16 adapter is stepped
    # in fp32 and rounded back; an fp32 one as plain AdamW steps it).
    trained = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in trained]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    one = []
    for batch in global_batches(2):
        parts = [model(input_ids=x, labels=x).loss for x in batch.split(PER_RANK)]
        (sum(parts) / 2).backward()
        for master, p in zip(masters, trained):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, trained):
                p.copy_(master)
        one.append([part.item() for part in parts])
    # (to the bit here; with the adapters of one dtype in the engine and the other in the
    # one process, they differ by 2e-5)
    assert runs[0][0] == pytest.approx([step[0] for step in one], rel=1e-6)


def test_marks_apply_to_the_parameters_of_the_module_that_makes_them():
    """A teacher that marks its routers beside a student that does not: only the
    teacher's are kept (as `from_pretrained` would have loaded each); PEFT's wrapped name
    matches its mark; fp32 compute keeps none."""
    from zero_strategy.layout.fp32_params import Fp32Parameters, fp32_patterns

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher, self.student = Marked(), Model()

    pair = Pair()
    kept = Fp32Parameters(fp32_patterns(pair, None, torch.bfloat16))
    names = [n for n, _ in pair.named_parameters() if kept([n])]
    assert names and all(n.startswith("teacher.inner.") and ".router." in n for n in names)
    assert len(names) == 3  # one router a block
    assert kept(["teacher.inner.blocks.0.router.base_layer.weight"])
    assert not Fp32Parameters(fp32_patterns(pair, None, torch.float32))
    fp16 = Fp32Parameters(fp32_patterns(pair, None, torch.float16))
    assert [n for n, _ in pair.named_parameters() if fp16([n])] == names
