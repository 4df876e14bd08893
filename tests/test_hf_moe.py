"""Hugging Face MoE models (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3) train expert-parallel with one
option, `expert_parallel_size`, and no change to their code: each rank holds its share of
the experts, the losses (each model's own auxiliary loss included) are those of the
unconverted model trained in one process, and what is saved loads with `from_pretrained`
in the model's own layout."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import preload, run_world
from zero_strategy import ZeroConfig, ZeroEngine

T = pytest.importorskip("transformers")
preload("zero_strategy.integrations.transformers")

VOCAB, SEQ, PER_RANK, STEPS = 64, 8, 2, 3
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
# Each architecture: its model class, its config class and the config's own settings
# (beside COMMON's).
ARCHS = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(intermediate_size=24, num_local_experts=4),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            intermediate_size=32,
            moe_intermediate_size=24,
            num_experts=4,
            head_dim=8,
            decoder_sparse_step=1,
        ),
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=24, num_experts=4)),
    # Transposed expert weights with biases.
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            intermediate_size=24,
            num_local_experts=4,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # Shared experts beside the routed ones, grouped routing, no auxiliary loss.
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            intermediate_size=32,
            moe_intermediate_size=24,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
    ),
}


def build(arch: str, **settings) -> torch.nn.Module:
    """The tiny `arch` with seed 0; `settings` override its config's."""
    model_class, config_class, own = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(T, config_class)(**{**COMMON, **own, **settings})
    return getattr(T, model_class)(config)


def expert_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Experts")}


def aux(output) -> torch.Tensor:
    """The model's auxiliary loss (zero for a model without one, as DeepSeek-V3)."""
    value = getattr(output, "aux_loss", None)
    return torch.zeros(()) if value is None else value.detach()


def global_batches(world: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g) for _ in range(steps)]


def one_process(arch: str, world: int = 2) -> list[tuple[float, float]]:
    """The unconverted model in one process, each step's batch split as the ranks split
    it (the auxiliary loss is computed over each rank's tokens): mean loss, mean aux."""
    model = build(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for batch in global_batches(world):
        parts = [model(input_ids=x, labels=x) for x in batch.split(PER_RANK)]
        loss = sum(p.loss for p in parts) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), float(sum(aux(p) for p in parts) / world)))
    return out


def _train(rank, world, arch, stage, ep_size, save=None):
    model = build(arch)
    experts_total = sum(p.numel() for m in expert_modules(model).values() for p in m.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, expert_parallel_size=ep_size))
    held = {n: m.num_experts for n, m in expert_modules(model).items()}
    report = engine.memory_report()
    out = []
    for batch in global_batches(world):
        x = batch.split(PER_RANK)[rank]
        result = model(input_ids=x, labels=x)
        engine.backward(result.loss)
        engine.step()
        engine.zero_grad()
        pair = torch.stack([result.loss.detach(), aux(result)])
        torch.distributed.all_reduce(pair)
        out.append(tuple((pair / world).tolist()))
    logits = None
    if save is not None:
        engine.save_checkpoint(save)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=global_batches(world)[0]).logits
    return out, held, report, experts_total, logits


def assert_close(ours, want):
    assert len(ours) == len(want)
    for (loss, aux), (want_loss, want_aux) in zip(ours, want):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert aux == pytest.approx(want_aux, rel=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_expert_parallel_matches_the_unconverted_model_in_one_process(arch, stage):
    want = one_process(arch)
    results = run_world(_train, 2, arch, stage, 2)
    for losses, held, report, experts_total, _ in results:
        assert_close(losses, want)
        assert set(held.values()) == {2}  # of 4 experts, in every layer
        # Before ZeRO shards anything further (the expert-data-parallel group is one rank
        # here), each rank holds exactly half of the expert parameters, in fp32.
        assert report["expert_parameters"] == 4 * experts_total // 2


def test_expert_parallel_1_keeps_every_expert_and_matches_too():
    want = one_process("mixtral")
    for losses, held, report, _, _ in run_world(_train, 2, "mixtral", 3, 1):
        assert_close(losses, want)
        assert set(held.values()) == {4}
        assert "expert_parameters" not in report  # experts are ordinary sharded weights


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_consolidated_model_loads_with_from_pretrained_and_gives_the_same_logits(arch, tmp_path):
    from zero_strategy.checkpoint.consolidate import consolidate

    checkpoint = tmp_path / "checkpoint"
    results = run_world(_train, 2, arch, 3, 2, str(checkpoint))
    out = tmp_path / "model"
    consolidate(checkpoint, out, show_progress=False)
    build(arch).config.save_pretrained(out)
    loaded = type(build(arch)).from_pretrained(out).eval()
    with torch.no_grad():
        logits = loaded(input_ids=global_batches(2)[0]).logits
    live = results[0][4]
    torch.testing.assert_close(logits, live, rtol=1e-5, atol=1e-6)
    assert torch.equal(live, results[1][4])
    # The experts sit in the model's own 3-D layout, every expert present.
    state = loaded.state_dict()
    (name,) = [n for n in state if n.endswith("layers.0.mlp.experts.gate_up_proj")]
    assert state[name].shape[0] == 4


def _built_on_meta(rank, world, source):
    from zero_strategy import init_on_meta

    with init_on_meta():
        model = T.MixtralForCausalLM(build("mixtral").config)
    assert all(p.is_meta for p in model.parameters())
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters()),
        ZeroConfig(stage=3, expert_parallel_size=2),
    )
    read = engine.load_pretrained(source)["elements_read"]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=global_batches(world)[0]).logits
    return read, logits


@pytest.mark.parametrize("layout", ["model", "checkpoint"])
def test_built_on_meta_each_rank_reads_only_its_experts_from_pretrained(layout, tmp_path):
    """From the model's own layout (3-D experts, as consolidated), or from the layout
    `save_pretrained` writes and the Hub holds (one matrix per expert, other names),
    converted by the model's own mapping, expert by expert."""
    from safetensors.torch import save_file

    reference = build("mixtral").eval()
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if layout == "model":
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        reference.save_pretrained(tmp_path)
        assert "model.layers.0.mlp.experts.gate_up_proj" not in _keys(tmp_path)
    total = sum(v.numel() for v in state.values())
    experts = sum(v.numel() for k, v in state.items() if ".experts." in k)
    results = run_world(_built_on_meta, 2, str(tmp_path))
    with torch.no_grad():
        want = reference(input_ids=global_batches(2)[0]).logits
    # Dense weights are halved by ZeRO-3 over both ranks, experts by expert parallelism
    # (one holder each): together every element is read exactly once.
    assert sum(read for read, _ in results) == total
    for read, logits in results:
        assert read < total - experts // 2 + 1
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


def _keys(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _refused(rank, world, which):
    if which == "dbrx":  # experts as [num_experts * ffn, hidden] matrices
        model = T.DbrxForCausalLM(
            T.DbrxConfig(
                d_model=16,
                n_heads=2,
                n_layers=1,
                max_seq_len=SEQ,
                vocab_size=VOCAB,
                attn_config={"rope_theta": 10000.0},
                ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
            )
        )
    else:  # a dense model
        model = T.LlamaForCausalLM(
            T.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=1,
                num_attention_heads=2,
            )
        )
    try:
        ZeroEngine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {"stage": 3, "expert_parallel_size": 2},
        )
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("which", "named"),
    [
        ("dbrx", "'transformer.blocks.0.ffn.experts'] that cannot be split"),
        ("llama", "no expert layers that can be split"),
    ],
)
def test_experts_that_cannot_be_split_are_refused_by_name(which, named):
    for message in run_world(_refused, 2, which):
        assert message is not None and named in message
        assert "expert_parallel_size=1" in message


def test_a_shared_expert_is_a_dense_layer_not_experts_that_cannot_be_split():
    """Aria's `AriaSharedExpertsMLP` beside its routed experts runs on every token: a
    dense layer, sharded as any other. It was once refused as experts that cannot be
    split (the architecture sweep found it); the routed experts are still converted."""
    from tiny_configs import tiny_model
    from zero_strategy.moe import transformers_experts

    model = tiny_model("aria_text", T.AutoModelForCausalLM)
    converted = transformers_experts.convertible(model)
    assert sorted(converted) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert any("shared_experts" in path for path, _ in model.named_modules())
    assert transformers_experts.unconvertible(model, list(converted)) == []


def test_experts_module_with_a_shared_weight_is_refused():
    """A weight that is not per expert (a norm shared by all) cannot be split by rows."""
    from zero_strategy.moe import transformers_experts

    model = build("mixtral")
    path, experts = next(iter(expert_modules(model).items()))
    experts.shared_scale = torch.nn.Parameter(torch.ones(16))
    with pytest.raises(ValueError, match=r"\['shared_scale'\] are not per-expert weights"):
        transformers_experts.convert(path, experts, 2, 0)


def _trainer(rank, world, kind, out):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")

    class Tokens(Dataset):
        ids = torch.randint(VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = build("mixtral")
    args = TrainingArguments(
        out,
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    if kind == "ddp":
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    else:
        from zero_strategy.integrations.accelerate import ZeroPlugin
        from zero_strategy.integrations.transformers import ZeroTrainer

        plugin = ZeroPlugin(stage=3, options={"expert_parallel_size": 2})
        trainer = ZeroTrainer(model=model, args=args, train_dataset=Tokens(), zero_plugin=plugin)
    trainer.train()
    held = {m.num_experts for m in expert_modules(trainer.model).values()}
    trainer.save_model()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=Tokens.ids[:2]).logits
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], held, logits


def test_zero_trainer_with_expert_parallel_matches_the_stock_trainer(tmp_path):
    """Same losses as the stock Trainer (DDP, every expert on every rank); save_model
    writes what from_pretrained loads, giving the trained model's logits."""
    stock = run_world(_trainer, 2, "ddp", str(tmp_path / "ddp"))
    ours = run_world(_trainer, 2, "zero", str(tmp_path / "zero"))
    for (losses, held, _), (want, want_held, _) in zip(ours, stock):
        assert (held, want_held) == ({2}, {4})
        assert len(losses) == len(want) == 4
        assert losses == pytest.approx(want, rel=1e-5)
    loaded = T.MixtralForCausalLM.from_pretrained(tmp_path / "zero").eval()
    ids = torch.randint(VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))[:2]
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    torch.testing.assert_close(logits, ours[0][2], rtol=1e-5, atol=1e-6)


def _resumable(rank, world, ep_size, stage, steps, checkpoint, load, save):
    model = build("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, expert_parallel_size=ep_size))
    if load:
        engine.load_checkpoint(checkpoint)
    losses = []
    for step in steps:
        x = global_batches(world, 4)[step].split(PER_RANK)[rank]
        loss = model(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(checkpoint)
    return losses


@pytest.mark.parametrize(("saved", "loaded"), [((2, 3), (1, 1)), ((1, 2), (2, 3))])
def test_checkpoint_continues_at_another_expert_parallel_size(saved, loaded, tmp_path):
    """Experts are stored by global id in the model's layout: a checkpoint written at one
    (expert_parallel_size, stage) continues at another exactly as without the break."""
    checkpoint = str(tmp_path / "checkpoint")
    full = run_world(_resumable, 2, *saved, range(4), checkpoint, False, False)
    run_world(_resumable, 2, *saved, range(2), checkpoint, False, True)
    resumed = run_world(_resumable, 2, *loaded, range(2, 4), checkpoint, True, False)
    for got, want in zip(resumed, full):
        assert got == pytest.approx(want[2:], rel=1e-5)


def _lightning_fit(rank, world):
    import lightning as L
    from lightning_helpers import quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy

    class LitMixtral(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build("mixtral")
            self.record = []

        def training_step(self, batch, batch_idx):
            x = global_batches(world)[batch_idx].split(PER_RANK)[self.global_rank]
            out = self.model(input_ids=x, labels=x)
            self.record.append((out.loss.item(), aux(out).item()))
            return out.loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    trainer = quiet_trainer(world, ZeroStrategy(stage=3, expert_parallel_size=2), max_steps=STEPS)
    module = LitMixtral()
    trainer.fit(module, torch.utils.data.DataLoader(torch.zeros(STEPS * world, 1)))
    return module.record, {m.num_experts for m in expert_modules(module.model).values()}


def _fabric_fit(rank, world):
    import lightning as L

    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    strategy = ZeroFabricStrategy(stage=2, expert_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = build("mixtral")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    record = []
    for batch in global_batches(world):
        x = batch.split(PER_RANK)[rank]
        out = model(input_ids=x, labels=x)
        fabric.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        record.append((out.loss.item(), aux(out).item()))
    return record, {m.num_experts for m in expert_modules(model).values()}


@pytest.mark.parametrize("door", ["lightning", "fabric"])
def test_lightning_and_fabric_take_the_option(door):
    want = one_process("mixtral")
    ranks = run_world(_lightning_fit if door == "lightning" else _fabric_fit, 2)
    assert all(held == {2} for _, held in ranks)
    mean = [tuple(sum(v) / 2 for v in zip(*steps)) for steps in zip(*(r for r, _ in ranks))]
    assert_close(mean, want)


def _to_first_two_experts(module, inputs, output):
    """A router hook: every token goes to experts 0 and 1 (expert-parallel rank 0's)."""
    logits, weights, index = output
    return logits, weights, torch.stack([torch.zeros_like(index[:, 0]), index[:, 0] * 0 + 1], 1)


def skewed(implementation: str) -> torch.nn.Module:
    model = build("mixtral")
    model.set_experts_implementation(implementation)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(_to_first_two_experts)
    return model


def train_on_batches(forward, engine, rank: int, world: int) -> list[float]:
    """`global_batches`, this rank's part of each, through `forward` (the model, or the
    engine) and `engine`'s backward and step: the losses."""
    losses = []
    for batch in global_batches(world):
        x = batch.split(PER_RANK)[rank]
        loss = forward(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _skewed_train(rank, world, stage, implementation):
    model = skewed(implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage, expert_parallel_size=2))
    return train_on_batches(model, engine, rank, world)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_rank_whose_experts_get_no_token_trains_on(stage, implementation):
    """Rank 1's experts receive nothing (and, with the eager implementation, take no part
    in autograd): nothing hangs, and training is the one-process model's."""
    model = skewed(implementation)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want = []
    for batch in global_batches(2):
        parts = [model(input_ids=x, labels=x).loss for x in batch.split(PER_RANK)]
        loss = sum(parts) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append([p.item() for p in parts])
    ranks = run_world(_skewed_train, 2, stage, implementation)
    for rank, losses in enumerate(ranks):
        assert losses == pytest.approx([w[rank] for w in want], rel=1e-5)
