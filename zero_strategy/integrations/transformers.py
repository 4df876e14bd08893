"""Hugging Face `Trainer` with ZeRO: `ZeroTrainer` is `transformers.Trainer` whose
Accelerator is a `ZeroAccelerator`.

    trainer = ZeroTrainer(model=model, args=args, train_dataset=data)  # was: Trainer(...)
    trainer.train()                       # torchrun / accelerate launch, CPU or CUDA
    trainer.save_model()                  # consolidated on the main process

The Trainer builds its own Accelerator inside `create_accelerator_and_postprocess`, so
there is no argument to hand it ours; the subclass swaps the class for that call only.
The Trainer's loop already goes through the Accelerator (`backward`, `no_sync`,
`clip_grad_norm_`, the prepared optimizer), so training needs nothing else. Saving does:
the stock Trainer reads `model.state_dict()` on the main process alone and pickles
`optimizer.state_dict()`, neither of which holds a sharded model. Here every rank takes
part in consolidating the model (`save_model`), checkpoints carry the engine's sharded
state in `zero_model/` beside the model file, and resuming restores it exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import transformers.trainer as hf_trainer
from transformers import Trainer

from ..builder.meta_init import init_on_meta
from ..checkpoint.pretrained import pretrained_files
from .accelerate import (
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    ZeroAccelerator,
    ZeroPlugin,
    engine_checkpoint_in,
)
from .adapters import trainable_state_dict
from .devices import place_buffers


class ZeroTrainer(Trainer):
    """`transformers.Trainer` over a `ZeroAccelerator`; `zero_plugin` as for it (default:
    the `ZERO_STRATEGY_*` environment, stage 3)."""

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any):
        self.zero_plugin = zero_plugin or ZeroPlugin()
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, str | os.PathLike):  # built on meta, loaded by shards
            model, path = model_on_meta(model)
            self.zero_plugin = dataclasses.replace(self.zero_plugin, pretrained=path)
            args, kwargs = (
                ((model, *args[1:]), kwargs) if args else (args, {**kwargs, "model": model})
            )
        super().__init__(*args, **kwargs)

    def _move_model_to_device(self, model, device) -> None:
        """Buffers only: the engine puts each unit's shard on the device as it shards the
        model, so the whole model never sits on one device (and a model built on the meta
        device has nothing to move)."""
        place_buffers(model, device)

    def create_accelerator_and_postprocess(self) -> None:
        if self.args.deepspeed or self.args.fsdp:
            raise ValueError(
                "ZeroTrainer shards the model itself; drop TrainingArguments.deepspeed and "
                "fsdp, or use transformers.Trainer for those."
            )
        original = hf_trainer.Accelerator
        hf_trainer.Accelerator = functools.partial(ZeroAccelerator, zero_plugin=self.zero_plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = original
        # Each node's local main process writes when save_on_each_node: get_state_dict then
        # consolidates on every rank.
        self.accelerator.project_configuration.save_on_each_node = self.args.save_on_each_node

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The engine shards the model in place: there is nothing to wrap, and asking
        `unwrap_model` whether it is wrapped would gather the whole model at stage 3."""
        engine = self.zero_engine
        if engine is not None and any(engine.manages(p) for p in model.parameters()):
            return model
        return super()._wrap_model(model, training, dataloader)

    def train(self, *args: Any, **kwargs: Any):
        """As Trainer's; at its end the engine finishes its work and destroys its process
        groups, so that a script that ends here exits cleanly (a later evaluate or save
        re-creates them)."""
        output = super().train(*args, **kwargs)
        if self.zero_engine is not None:
            self.zero_engine.close()
        return output

    @property
    def zero_engine(self):
        return getattr(self.accelerator, "engine", None)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidate on every rank (collective), write from the main process. A PEFT
        model saves its adapter, so only the trainable units are gathered."""
        if self.zero_engine is None:
            return super().save_model(output_dir, _internal_call)
        if _is_peft_model(self.model):
            everywhere = bool(self.args.save_on_each_node)
            state_dict = trainable_state_dict(self.model, rank0_only=not everywhere)
        else:
            state_dict = self.accelerator.get_state_dict(self.model)
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.zero_engine is not None:
            self.accelerator.write_engine_checkpoint(output_dir)
        super()._save_optimizer_and_scheduler(output_dir)  # scheduler; a marker optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.zero_engine is not None:
            saved = engine_checkpoint_in(checkpoint)
            if not os.path.exists(saved):
                raise FileNotFoundError(
                    f"{checkpoint} has no {CHECKPOINT_DIR}/ or {CHECKPOINT_FILE} (the model and "
                    "optimizer state ZeroTrainer writes); resume from a checkpoint ZeroTrainer "
                    "saved."
                )
            self.zero_engine.load_checkpoint(saved)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's sharded fp32 masters, each rank
        reading its own ranges (the stock path loads the whole model file on every rank
        and rounds it through the compute dtype)."""
        best = self.state.best_model_checkpoint
        saved = engine_checkpoint_in(best) if best else ""
        if self.zero_engine is None or not os.path.exists(saved):
            return super()._load_best_model()
        self.zero_engine.load_checkpoint(saved, load_optimizer_states=False)


@functools.cache
def with_zero(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` on ZeRO: TRL's `SFTTrainer`, `DPOTrainer`, `GRPOTrainer`, or any
    `transformers.Trainer` subclass, with `ZeroTrainer` first in its bases, so that its
    Accelerator, saving and loading come first and the trainer's own loss and data
    handling are kept. One line:

        trainer = with_zero(SFTTrainer)(model=..., args=..., train_dataset=...)

    The same class as `class ZeroSFTTrainer(ZeroTrainer, SFTTrainer): pass`."""
    if issubclass(trainer_class, ZeroTrainer):
        return trainer_class
    return type(f"Zero{trainer_class.__name__}", (ZeroTrainer, trainer_class), {})


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def model_on_meta(name_or_path: str | os.PathLike):
    """(model, weights path): the architecture a Hugging Face checkpoint names (its
    config's `architectures`), built on the meta device, and where its safetensors are,
    for the engine to load each rank's ranges once it has sharded the model. A Hub name
    downloads the config and safetensors files only."""
    import transformers

    path = pretrained_files(name_or_path)
    config = transformers.AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    classes = [getattr(transformers, name, None) for name in names]
    if not classes or classes[0] is None:
        raise ValueError(
            f"The config at {path} names no Transformers architecture ({names}); build the "
            "model yourself on the meta device (zero_strategy.init_on_meta()) and pass "
            "ZeroPlugin(pretrained=path)."
        )
    with init_on_meta():
        model = classes[0]._from_config(config)
    return model, path
