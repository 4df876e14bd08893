"""Lightning: the ZeRO strategy's checkpoint methods.

Lightning's `_CheckpointConnector` fills a checkpoint from the strategy's
`lightning_module_state_dict()` and `optimizer_state()`, then hands it to
`save_checkpoint()`. With an engine those two hand empty markers during a save, and the
engine writes the model and optimizer from its shards (a sharded directory, or with
`state_dict_type="full"` one file), the trainer's own state (loops, callbacks,
schedulers) beside them; asked by user code they hand the whole state on rank 0, as
`FSDPStrategy(state_dict_type="full")` does. Without an engine in this process (the main
process after a spawned fit, which got rank 0's trained weights back in a plain module)
the module is whole on its own and everything is DDP's. A mixin of the ZeRO strategy
class: `super()` is Lightning's `DDPStrategy`.
"""

from __future__ import annotations

from abc import ABC
from typing import Any

from zero_strategy import ZeroEngine

from .client_state import client_state
from .lightning_model_state import (
    EngineModelState,
    after_loading,
    for_saving,
    in_module_order,
    model_key,
)
from .private_api import dumping_a_checkpoint


class CheckpointMethods(ABC):  # (as Strategy: the layout a DDPStrategy can change class to)
    engine: ZeroEngine | None
    state_dict_type: str

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.engine is None  # else the engine restores its sharded state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state on rank 0 (fp32, in CPU memory, gathered one unit at a
        time; empty elsewhere), as FSDPStrategy's "full" hands it. Collective. When
        Lightning fills a checkpoint with it: an empty marker that a callback moving the
        state dict carries along (`lightning_model_state.py`), the engine writing the
        model from its shards."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        if dumping_a_checkpoint():
            return EngineModelState()
        return in_module_order(self.engine.full_state_dict(), self.lightning_module)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """torch's `state_dict()` of `optimizer` unsharded, on rank 0 (empty elsewhere).
        Collective. Empty when a checkpoint is filled: the engine writes the optimizer
        state from its shards."""
        if self.engine is None:
            return super().optimizer_state(optimizer)
        if dumping_a_checkpoint():
            return {}
        return self.engine.full_optimizer_state_dict(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(
                "The ZeRO strategy writes its own sharded directory; storage_options are "
                "not supported. Drop them or use a CheckpointIO with strategy='ddp'."
            )
        if self.engine is None:
            super().save_checkpoint(checkpoint, filepath)
            return
        # Rank 0's path, as Lightning's FSDP and DeepSpeed strategies take it: ranks may
        # name different ones (each its own temporary directory), and the sharded files
        # must land together.
        filepath = self.broadcast(str(filepath), src=0)
        key = model_key(checkpoint)
        leave_out, added = for_saving(checkpoint, key)
        client = {**client_state(checkpoint, drop_keys=leave_out), **added}
        one_file = self.state_dict_type == "full"
        self.engine.save_checkpoint(str(filepath), client, one_file=one_file)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if self.engine is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        # Evaluation runs hold a stand-in optimizer: read the model alone.
        fitting = self.lightning_module.trainer.state.fn == "fit"
        client = self.engine.load_checkpoint(str(checkpoint_path), fitting) or {}
        after_loading(client, lambda: self.engine.full_state_dict(rank0_only=False))
        return client

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state = checkpoint.get("state_dict")
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict)
        elif state and not isinstance(state, EngineModelState):
            # A callback's in place of the model's (WeightAveraging's averaged weights):
            # loaded as DDP loads it; the engine loaded the model already.
            self.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Nothing: with an engine, `load_checkpoint` restored the optimizer state from
        its shards."""
        return None
