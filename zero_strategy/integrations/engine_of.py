"""Which engine shards a module.

The module keeps its engine alive (as a DDP wrapper would), through a slot that copies
and pickles as empty: Lightning's weight-averaging callbacks `copy.deepcopy` the
LightningModule, and process groups cannot be copied. A copy is a plain module."""

from __future__ import annotations

from torch import nn

from zero_strategy import ZeroEngine

_SLOT = "_zero_engine_slot"


class _EngineSlot:
    def __init__(self, engine: ZeroEngine | None) -> None:
        self.engine = engine

    def __deepcopy__(self, memo) -> _EngineSlot:
        return _EngineSlot(None)

    def __reduce__(self):
        return (_EngineSlot, (None,))


def engine_of(module: nn.Module) -> ZeroEngine | None:
    """The engine sharding `module`, if any."""
    slot = module.__dict__.get(_SLOT)
    return slot.engine if slot is not None else None


def attach(module: nn.Module, engine: ZeroEngine | None) -> None:
    """Record (or with None, forget) the engine sharding `module`."""
    module.__dict__[_SLOT] = _EngineSlot(engine)
