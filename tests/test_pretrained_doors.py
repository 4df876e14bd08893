"""Pretrained weights through every door, loaded by shards: the model is built on the meta
device, sharded, then each rank reads its own ranges of a Hub-style sharded safetensors
set. The result computes what `from_pretrained` in one plain process computes."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_world

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16


def _config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )


def _ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, float]:
    """A tiny Llama saved as the Hub stores it (index plus several shards), and the loss
    `from_pretrained` gives on a fixed batch."""
    out = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_config()).save_pretrained(out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").exists()
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        loss = model(input_ids=_ids(), labels=_ids()).loss.item()
    return str(out), loss


def _meta_llama():
    import zero_strategy

    with zero_strategy.init_on_meta():
        return transformers.LlamaForCausalLM(_config())


def _loss_of(model) -> float:
    with torch.no_grad():
        return model(input_ids=_ids(), labels=_ids()).loss.item()


def _accelerate(rank, world, path):
    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29540")
    accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(stage=3, pretrained=path))
    model = _meta_llama()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    loss = _loss_of(model)
    accelerator.end_training()
    return loss


def _fabric(rank, world, path):
    import lightning as L

    from zero_strategy.integrations.fabric import ZeroFabricStrategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    strategy = ZeroFabricStrategy(stage=3, pretrained=path)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(_config())
    model, _ = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    loss = _loss_of(model)
    strategy.teardown()
    return loss


def _lightning(rank, world, path):
    import lightning as L
    from lightning_helpers import quiet_trainer

    from zero_strategy.integrations.lightning import ZeroStrategy

    class Lit(L.LightningModule):
        def configure_model(self):  # on the meta device here
            self.model = transformers.LlamaForCausalLM(_config())

        def validation_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("val_loss", loss)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_ids()), batch_size=2)
    strategy = ZeroStrategy(stage=3, pretrained=path)
    trainer = quiet_trainer(world, strategy, use_distributed_sampler=False)
    # Each rank validates the whole batch (no sampler): the loss of the whole model.
    trainer.validate(Lit(), data, verbose=False)
    return trainer.callback_metrics["val_loss"].item()


@pytest.mark.parametrize("door", [_accelerate, _fabric, _lightning], ids=lambda f: f.__name__)
def test_pretrained_weights_load_through_the_door(door, saved):
    path, expected = saved
    for loss in run_world(door, 2, path):
        assert loss == pytest.approx(expected, rel=1e-6)


def _train_named(rank, world, path, out, zero):
    from zero_strategy.integrations.transformers import ZeroTrainer

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29542")
    rows = [
        {"input_ids": row, "labels": row}
        for row in torch.randint(1, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(0))
    ]
    args = transformers.TrainingArguments(
        out,
        use_cpu=True,
        report_to=[],
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
    )
    if zero:  # a name or path: built on the meta device, each rank reading its ranges
        trainer = ZeroTrainer(model=path, args=args, train_dataset=rows)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(path)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_zero_trainer_from_a_path_trains_as_the_stock_trainer_from_pretrained(saved, tmp_path):
    path, _ = saved
    stock = run_world(_train_named, 2, path, str(tmp_path / "stock"), False)[0]
    ours = run_world(_train_named, 2, path, str(tmp_path / "zero"), True)[0]
    assert len(ours) == 3
    assert ours == pytest.approx(stock, rel=1e-5)


def test_a_path_that_is_neither_local_nor_on_the_hub_names_the_fix(tmp_path):
    from zero_strategy.checkpoint.pretrained import pretrained_files

    with pytest.raises(FileNotFoundError, match="neither a local path nor a Hub model"):
        pretrained_files(str(tmp_path / "no" / "such" / "model"))


def test_trainable_state_dict_of_an_unsharded_module_names_the_fix():
    import zero_strategy

    with pytest.raises(ValueError, match="No ZeroEngine shards this Linear"):
        zero_strategy.trainable_state_dict(torch.nn.Linear(2, 2))


def load_by_shards(rank, world, family: str, model_type: str, path: str) -> dict:
    """`model_type` built tiny on the meta device, sharded at stage 3, loaded from `path`
    by shards: its whole state."""
    import zero_strategy
    from tiny_configs import tiny_model
    from zero_strategy import ZeroConfig, ZeroEngine

    with zero_strategy.init_on_meta():
        model = tiny_model(model_type, getattr(transformers, family))
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    engine.load_pretrained(path)
    state = engine.full_state_dict()
    engine.close()
    return state


def saved_tiny(family: str, model_type: str, out) -> dict:
    """`model_type` built tiny and saved as the Hub keeps it (several shards); the state
    `from_pretrained` gives from it."""
    from tiny_configs import tiny_model

    auto = getattr(transformers, family)
    tiny_model(model_type, auto).save_pretrained(out, max_shard_size="200KB")
    model, info = auto.from_pretrained(out, output_loading_info=True)
    lost = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if lost:  # Transformers' own round trip is lossy (DeepSeek-V4's final norm)
        raise ValueError(f"from_pretrained of what save_pretrained wrote: {lost}")
    return model.state_dict()


@pytest.mark.parametrize(
    ("family", "model_type"),
    [
        ("AutoModelForMaskedLM", "nomic_bert"),  # a fused QKV the model chunks into three
        ("AutoModelForCausalLM", "kimi_linear"),  # convolutions concatenated; `\.experts.*`
        ("AutoModelForSeq2SeqLM", "marian"),  # sinusoidal positions its checkpoints leave out
        ("AutoModelForCausalLM", "laguna"),  # a router's trainable weight and frozen bias
        ("AutoModelForMaskedLM", "modernvbert"),  # SigLIP's embeddings' init draws a child
        ("AutoModelForCausalLM", "deepseek_v4"),  # `model.norm` under a rule for `.norm.`
        ("AutoModelForImageTextToText", "minicpm_ocr"),  # a layer's own `_init_weights()`
        ("AutoModelForCausalLM", "apertus"),  # buffers no initialiser makes: loaded
    ],
)
def test_a_transformers_layout_loads_by_shards_as_from_pretrained(family, model_type, tmp_path):
    """Architectures the sweep (`test_architecture_sweep.py`) found refused on the
    sharded pretrained path, one for each cause: each now holds what `from_pretrained`
    gives, to the bit."""
    want = saved_tiny(family, model_type, tmp_path)
    state = run_world(load_by_shards, 2, family, model_type, str(tmp_path))[0]
    assert state.keys() >= want.keys()
    assert all(torch.equal(state[name], value) for name, value in want.items())
