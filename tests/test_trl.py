"""TRL's trainers on ZeRO by one line: `with_zero(SFTTrainer)` and `with_zero(DPOTrainer)`
train as TRL's own trainers do on DDP (2 ranks, a tiny Llama, a few steps), and DPO's
frozen reference model is sharded too: 1/N of its parameters per rank, no gradient or
optimizer state."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import preload, run_world

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install trl")
datasets = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")
transformers = pytest.importorskip("transformers")
preload("zero_strategy.integrations.transformers", "transformers.models.llama.modeling_llama")

VOCAB, WORDS, STEPS = 64, 12, 3


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config)


def _words(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(2, VOCAB, (n, WORDS), generator=g).tolist()
    return [" ".join(f"w{t - 2}" for t in row) for row in rows]


def _env() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29545")


def _common(out: str) -> dict:
    return dict(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
    )


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _sft(rank, world, out, zero):
    from zero_strategy.integrations.transformers import with_zero

    _env()
    data = datasets.Dataset.from_dict({"text": _words(16, 0)})
    args = trl.SFTConfig(**_common(out), max_length=32, packing=False)
    cls = with_zero(trl.SFTTrainer) if zero else trl.SFTTrainer
    trainer = cls(model=_model(), args=args, train_dataset=data, processing_class=_tokenizer())
    trainer.train()
    return _losses(trainer)


def test_sft_trainer_with_zero_trains_as_trl_on_ddp(tmp_path):
    stock = run_world(_sft, 2, str(tmp_path / "ddp"), False)[0]
    ours = run_world(_sft, 2, str(tmp_path / "zero"), True)[0]
    assert len(ours) == STEPS
    assert ours == pytest.approx(stock, rel=1e-5)


def _dpo(rank, world, out, zero):
    from zero_strategy.integrations.engine_of import engine_of
    from zero_strategy.integrations.transformers import with_zero

    _env()
    prompts, chosen, rejected = _words(16, 1), _words(16, 2), _words(16, 3)
    data = datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    args = trl.DPOConfig(**_common(out), max_length=40)
    cls = with_zero(trl.DPOTrainer) if zero else trl.DPOTrainer
    trainer = cls(
        model=_model(),
        ref_model=_model(),
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
    )
    trainer.train()
    reference = None
    if zero:
        ref = trainer.ref_model
        engine = engine_of(getattr(ref, "module", ref))
        reference = {
            "report": engine.memory_report(),
            "numel": sum(engine.parameter_numel(p) for p in ref.parameters()),
        }
    return _losses(trainer), reference


def test_dpo_trainer_with_zero_trains_as_trl_on_ddp_and_shards_the_reference(tmp_path):
    stock = run_world(_dpo, 2, str(tmp_path / "ddp"), False)[0][0]
    results = run_world(_dpo, 2, str(tmp_path / "zero"), True)
    assert len(results[0][0]) == STEPS
    assert results[0][0] == pytest.approx(stock, rel=1e-5)
    for _, reference in results:  # each rank: half the reference model, nothing else
        report, numel = reference["report"], reference["numel"]
        assert report["gradients"] == 0 and report["optimizer_state"] == 0
        assert 4 * numel / 2 <= report["parameters"] <= 4 * (numel / 2 + 2 * 8)


def _length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c.split())) for c in completions]


def _grpo(rank, world, out, zero):
    from zero_strategy.integrations.transformers import with_zero

    _env()
    data = datasets.Dataset.from_dict({"prompt": _words(16, 4)})
    common = {**_common(out), "per_device_train_batch_size": 4}
    args = trl.GRPOConfig(**common, num_generations=4, max_completion_length=6)
    cls = with_zero(trl.GRPOTrainer) if zero else trl.GRPOTrainer
    trainer = cls(
        model=_model(),
        reward_funcs=_length_reward,
        args=args,
        train_dataset=data,
        processing_class=_tokenizer(),
    )
    trainer.train()
    return _losses(trainer), [e.get("reward") for e in trainer.state.log_history if "reward" in e]


def test_grpo_trainer_with_zero_trains_as_trl_on_ddp(tmp_path):
    """Generation inside the training step (stage 3 gathers each block as generate runs
    it), rewards, and the policy loss: as TRL's GRPO on DDP."""
    stock = run_world(_grpo, 2, str(tmp_path / "ddp"), False)[0]
    ours = run_world(_grpo, 2, str(tmp_path / "zero"), True)[0]
    assert len(ours[0]) == STEPS
    assert ours[1] == pytest.approx(stock[1], rel=1e-5)  # the same completions sampled
    assert ours[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-6)
