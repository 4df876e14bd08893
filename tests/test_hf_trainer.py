"""ZeroTrainer: Hugging Face's Trainer under ZeRO trains as the stock Trainer (DDP) does,
resumes from its own checkpoints exactly, and saves a model `from_pretrained` loads."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import preload, run_world, warm_the_compiler

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
warm_the_compiler()  # one test compiles in its ranks
preload("zero_strategy.integrations.transformers")

STEPS = 6


def _train(rank, world, kind, out, stage=3, resume=None, max_steps=STEPS, seed=0, **args):
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    # Accelerate raises a CPU process to 2 threads unless this is set; in a rank forked
    # from a parent whose OpenMP pool is already up, that can deadlock.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")

    class Tokens(Dataset):
        def __init__(self):
            self.ids = torch.randint(100, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    if args.get("torch_compile") is not None:  # a compiled graph draws other dropout masks
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    lora = args.pop("lora", False)
    state_dict_type = args.pop("state_dict_type", "sharded")
    if lora:  # LoRA adapters on a frozen base, the common ZeRO-3 fine-tuning case
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0))
    arguments = TrainingArguments(
        out,
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        max_grad_norm=0.5,
        logging_steps=1,
        save_steps=3,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **args,
    )
    evaluation = Tokens() if args.get("eval_strategy") else None
    if kind == "ddp":
        trainer = Trainer(
            model=model, args=arguments, train_dataset=Tokens(), eval_dataset=evaluation
        )
    else:
        from zero_strategy.integrations.accelerate import ZeroPlugin
        from zero_strategy.integrations.transformers import ZeroTrainer

        trainer = ZeroTrainer(
            model=model,
            args=arguments,
            train_dataset=Tokens(),
            eval_dataset=evaluation,
            zero_plugin=ZeroPlugin(stage=stage, state_dict_type=state_dict_type),
        )
    trainer.train(resume_from_checkpoint=resume)
    if args.get("load_best_model_at_end"):
        state = trainer.accelerator.get_state_dict(trainer.model)
        return trainer.state.best_model_checkpoint, state
    trainer.save_model()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    if lora:
        return logs, sorted(os.listdir(out))
    if args.get("torch_compile"):
        return logs, torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return logs, type(trainer.accelerator).__name__


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """The stock Trainer (DDP): its logs per rank, and the directory it saved the model in."""
    out = str(tmp_path_factory.mktemp("ddp"))
    return run_world(_train, 2, "ddp", out), out


@pytest.mark.parametrize("stage", [2, 3])
def test_same_losses_and_grad_norms_as_the_stock_trainer(stage, stock, tmp_path):
    for (ours, accelerator), (theirs, _) in zip(
        run_world(_train, 2, "zero", str(tmp_path), stage), stock[0]
    ):
        assert accelerator == "ZeroAccelerator"
        assert len(ours) == len(theirs) == STEPS
        for (loss, norm), (want_loss, want_norm) in zip(ours, theirs):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_from_a_checkpoint_continues_exactly(tmp_path, state_dict_type):
    """The engine's checkpoint in each Trainer checkpoint: the sharded directory, or
    with `ZeroPlugin(state_dict_type="full")` one file; either resumes bit for bit."""
    out, kind = str(tmp_path), {"state_dict_type": state_dict_type}
    full = run_world(_train, 2, "zero", out, **kind)
    checkpoint = os.path.join(out, "checkpoint-3")
    saved = {"sharded": "zero_model", "full": "zero_model.pt"}[state_dict_type]
    assert sorted(f for f in os.listdir(checkpoint) if f.startswith("zero_model")) == [saved]
    # Another seed: the weights and optimizer state must come from the checkpoint.
    resumed = run_world(_train, 2, "zero", out + "-resumed", 3, checkpoint, STEPS, 7, **kind)
    for (logs, _), (want, _) in zip(resumed, full):
        # The log history of steps 1-3 comes back with trainer_state.json; 4-6 are new.
        assert logs == want


def test_saved_model_loads_with_from_pretrained(tmp_path, stock):
    """save_model consolidates the sharded model; it matches what the stock Trainer saved."""
    from transformers import GPT2LMHeadModel

    run_world(_train, 2, "zero", str(tmp_path))
    ours = GPT2LMHeadModel.from_pretrained(str(tmp_path)).state_dict()
    theirs = GPT2LMHeadModel.from_pretrained(stock[1]).state_dict()
    assert ours.keys() == theirs.keys()
    num = sum(((ours[k] - theirs[k]).double() ** 2).sum() for k in theirs)
    den = sum((theirs[k].double() ** 2).sum() for k in theirs)
    assert float((num / den).sqrt()) < 1e-5


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    from safetensors.torch import load_file

    best, state = run_world(
        _train,
        2,
        "zero",
        str(tmp_path),
        load_best_model_at_end=True,
        eval_strategy="steps",
        eval_steps=3,
        metric_for_best_model="loss",
        greater_is_better=True,  # the higher loss of step 3: not the final weights
    )[0]
    assert best.endswith("checkpoint-3")
    saved = load_file(os.path.join(best, "model.safetensors"))
    for name, value in saved.items():  # fp32 model: the checkpoint's exact values
        assert torch.equal(state[name], value), name


def test_bf16_gradient_checkpointing_and_evaluation_match_the_stock_trainer(tmp_path):
    """bf16 autocast, gradient checkpointing and an evaluation loop at stage 3."""
    options = dict(bf16=True, gradient_checkpointing=True, eval_strategy="steps", eval_steps=3)
    stock = run_world(_train, 2, "ddp", str(tmp_path / "ddp"), **options)
    ours = run_world(_train, 2, "zero", str(tmp_path / "zero"), **options)
    for (logs, _), (want, _) in zip(ours, stock):
        for (loss, norm), (want_loss, want_norm) in zip(logs, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def test_lora_on_a_frozen_base_matches_the_stock_trainer(tmp_path):
    """PEFT LoRA at stage 3: the frozen base weights stay gathered until backward has left
    each block; the adapter is what save_model writes."""
    pytest.importorskip("peft")
    stock = run_world(_train, 2, "ddp", str(tmp_path / "ddp"), lora=True)
    ours = run_world(_train, 2, "zero", str(tmp_path / "zero"), lora=True)
    for (logs, _), (want, _) in zip(ours, stock):
        for (loss, norm), (want_loss, want_norm) in zip(logs, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)
    assert "adapter_model.safetensors" in ours[0][1]  # written by the main process
    # save_model gathers the adapter's units alone (trainable_state_dict): the same
    # tensors as the stock Trainer's file, none of them empty.
    from safetensors.torch import load_file

    mine = load_file(tmp_path / "zero" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "ddp" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and all(t.numel() > 0 for t in mine.values())
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_torch_compile_trains_as_the_eager_zero_trainer(tmp_path):
    """`TrainingArguments(torch_compile=True)`: the Trainer hands Accelerate a dynamo
    plugin, the ZeroAccelerator compiles the sharded model, and it trains with the eager
    run's losses and gradient norms (dropout off in both: compiled RNG differs)."""
    eager = run_world(_train, 2, "zero", str(tmp_path / "eager"), torch_compile=False)
    compiled = run_world(
        _train,
        2,
        "zero",
        str(tmp_path / "compiled"),
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    for (logs, graphs), (want, _) in zip(compiled, eager):
        assert graphs > 0
        for (loss, norm), (want_loss, want_norm) in zip(logs, want, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-4)
            assert norm == pytest.approx(want_norm, rel=1e-4)
