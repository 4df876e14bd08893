"""LoRA (PEFT) on a frozen base at every stage: trains as one process does (with Hugging
Face gradient checkpointing, reentrant and not), the frozen base holds no gradient or
optimizer state, and the adapter's state is split evenly over the ranks."""

from __future__ import annotations

import functools

import pytest
import safetensors.torch
import torch

import zero_strategy
from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine

peft = pytest.importorskip("peft", reason="PEFT is an optional extra: pip install peft")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS, STEPS = 96, 16, 4, 3
TARGETS = ["q_proj", "v_proj", "up_proj"]


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )


def lora_model(checkpointing: str | None = None) -> torch.nn.Module:
    """A tiny Llama with LoRA adapters; checkpointing enabled on the base first, as TRL
    and PEFT's docs do (PEFT then makes the embeddings' output require grad)."""
    base = base_model()
    if checkpointing is not None:
        base.train()
        base.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(base, config)
    # PEFT starts B at zero: a first step then moves A by nothing. Random B makes every
    # adapter weight take part from the first step.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def adapter_state(named) -> dict[str, torch.Tensor]:
    return {n: v.detach().clone() for n, v in named if "lora_" in n}


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


@functools.cache
def one_process(checkpointing: str | None):
    model = lora_model(checkpointing)
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, adapter_state(model.named_parameters())


def _train(rank, world, stage, checkpointing):
    model = lora_model(checkpointing)
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    rows = ROWS // world
    losses = []
    for step in range(STEPS):
        ids = batch(step)[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(torch.tensor(loss.item()))
    mean = torch.stack(losses)
    torch.distributed.all_reduce(mean)
    state = adapter_state(engine.full_state_dict(rank0_only=False).items())
    report = engine.memory_report()
    # The moments AdamW keeps, by element (each view of this rank's slices has them).
    report["moment_elements"] = sum(s["exp_avg"].numel() for s in optimizer.state.values())
    report["steps"] = len(optimizer.state)
    engine.close()
    return (mean / world).tolist(), state, report


@functools.cache
def two_ranks(stage: int, checkpointing: str | None):
    return run_world(_train, 2, stage, checkpointing)


# Every stage without recomputation and with each of Hugging Face's two checkpointing modes.
RUNS = [(stage, mode) for stage in (0, 1, 2, 3) for mode in (None, "reentrant", "non-reentrant")]


@pytest.mark.parametrize("stage,checkpointing", RUNS)
def test_lora_trains_as_one_process(stage, checkpointing):
    ref_losses, ref_state = one_process(checkpointing)
    (losses, state, _), _ = two_ranks(stage, checkpointing)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert state.keys() == ref_state.keys() and ref_state
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    moved = [n for n, v in ref_state.items() if not torch.equal(v, lora_model().state_dict()[n])]
    assert len(moved) == len(ref_state)  # every adapter weight trained


def _trainable_sizes() -> list[int]:
    return [p.numel() for p in lora_model().parameters() if p.requires_grad]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adapter_state_is_split_evenly_and_the_frozen_base_holds_none(stage):
    """AdamW keeps two fp32 moments per trainable element and a 4-byte step per state:
    over the ranks, exactly the adapter's elements, each rank 1/N of them give or take
    one tensor. Gradient buffers hold adapter elements only (the base's 99% has none),
    padded to the ranks at most."""
    sizes = _trainable_sizes()
    total, world = sum(sizes), 2
    reports = [report for _, _, report in two_ranks(stage, None)]
    shares = [report["moment_elements"] for report in reports]
    assert sum(shares) == total
    for share, report in zip(shares, reports):
        assert abs(share - total / world) <= max(sizes), shares
        assert report["optimizer_state"] == 8 * share + 4 * report["steps"]
    grads = [report["gradients"] for report in reports]
    per_rank = total if stage == 1 else total / world  # stage 1 reduces whole buckets
    for held in grads:
        assert 4 * per_rank <= held <= 4 * (per_rank + 4 * world), grads


def _save_both_ways(rank, world, stage, out):
    model = lora_model()
    engine = ZeroEngine(model, _optimizer(model), ZeroConfig(stage=stage))
    rows = ROWS // world
    for step in range(STEPS):
        ids = batch(step)[rank * rows : (rank + 1) * rows]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.zero_grad()
    # As PEFT's docs say, on every rank (state_dict() is collective at stage 3) ...
    model.save_pretrained(f"{out}/natural", is_main_process=rank == 0)
    # ... and the adapter alone, gathering none of the frozen base.
    engine.reset_comm_report()
    state = zero_strategy.trainable_state_dict(model)
    gathered = engine.comm_report()
    model.save_pretrained(f"{out}/adapter_only", is_main_process=rank == 0, state_dict=state)
    engine.close()
    return gathered


def _logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch(99)).logits


@pytest.mark.parametrize("stage", [1, 3])
def test_peft_save_pretrained_writes_the_whole_adapter(stage, tmp_path):
    """Both calls write whole, non-empty adapter files (not the `torch.Size([0])` shards
    ZeRO-3 users meet) that `PeftModel.from_pretrained` loads in one plain process,
    giving the outputs of the adapter trained in one process."""
    moved = run_world(_save_both_ways, 2, stage, str(tmp_path))
    adapter = sum(_trainable_sizes())
    for report in moved:  # the adapter's fp32 values, padding at most: no frozen unit
        assert 4 * adapter <= sum(kind["bytes"] for kind in report.values()) <= 4 * adapter + 64
    reference = lora_model()
    reference.load_state_dict(one_process(None)[1], strict=False)
    expected = _logits_of(reference)
    shapes = {n: p.shape for n, p in reference.named_parameters() if "lora_" in n}
    for way in ("natural", "adapter_only"):
        saved = safetensors.torch.load_file(tmp_path / way / "adapter_model.safetensors")
        assert len(saved) == len(shapes)
        assert all(t.numel() > 0 for t in saved.values())
        loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / way)
        torch.testing.assert_close(_logits_of(loaded), expected, rtol=1e-5, atol=1e-5, msg=way)


def _meta_built(rank, world, stage, path):
    """The PEFT model built on the meta device and its base loaded by shards; then the
    adapter values of `lora_model()` written in, and trained as `_train` does."""
    with zero_strategy.init_on_meta():
        base = base_model()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(base, config)
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    engine.load_pretrained(path)  # into the PEFT model's base, by the base's names
    with torch.no_grad():
        start = engine(input_ids=batch(99)).logits
        zero_b = all(
            bool((v == 0).all()) for n, v in engine.full_state_dict(False).items() if "lora_B" in n
        )
    model.load_state_dict(adapter_state(lora_model().state_dict().items()), strict=False)
    rows = ROWS // world
    losses = []
    for step in range(STEPS):
        ids = batch(step)[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = torch.tensor(loss.item())
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    state = adapter_state(engine.full_state_dict(rank0_only=False).items())
    engine.close()
    return start, zero_b, losses, state


@pytest.mark.parametrize("stage", [1, 3])
def test_a_peft_model_built_on_meta_loads_its_base_by_shards_and_trains(stage, tmp_path):
    """PEFT's own init on the meta-built adapters (B at zero: the model starts as its
    base), the base read by shards through PEFT's `base_layer` names, then the same
    training as one process."""
    base_model().save_pretrained(tmp_path, max_shard_size="100KB")
    start, zero_b, losses, state = run_world(_meta_built, 2, stage, str(tmp_path))[0]
    assert zero_b
    with torch.no_grad():
        torch.testing.assert_close(start, base_model()(input_ids=batch(99)).logits)
    ref_losses, ref_state = one_process(None)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _meta_with_init(rank, world, init):
    with zero_strategy.init_on_meta():
        base = base_model()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=TARGETS))
    model.peft_config["default"].init_lora_weights = init  # one that reads the base
    ZeroEngine(model, _optimizer(model), ZeroConfig(stage=3))


def test_a_meta_built_adapter_whose_init_reads_the_base_is_refused_naming_the_way_out():
    results = run_world(_meta_with_init, 2, "olora", expect_errors=True)
    for status, payload in results:
        assert status == "error"
        assert "init_lora_weights='olora', which reads the base weights" in payload
        assert "Build this PEFT model on real memory" in payload
