"""The framework's own checkpoint entries, saved beside the engine's sharded files.

Lightning's and Fabric's checkpoints hold trainer state (loops, callbacks, schedulers,
user entries) next to the model and optimizer. The engine saves the model and optimizer
itself, sharded; the rest goes into its `client_state`, which is read back with
`torch.load(weights_only=True)`, so it is reduced here to what that accepts.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import torch


def client_state(
    checkpoint: Mapping[str, Any],
    drop_keys: tuple[str, ...] = (),
    drop_types: tuple[type, ...] = (),
) -> dict[str, Any]:
    """The entries of `checkpoint` the engine does not save itself (Lightning names them by
    key, "state_dict" and "optimizer_states"; Fabric's are the modules and optimizers
    among the values), ready for weights-only loading."""
    kept = {
        k: v for k, v in checkpoint.items() if k not in drop_keys and not isinstance(v, drop_types)
    }
    return to_weights_only(kept)


def to_weights_only(value: Any, where: str = "checkpoint") -> Any:
    """Trainer state reduced to what `torch.load(weights_only=True)` accepts: containers,
    numbers, strings, tensors. Anything else is kept as its repr, with a warning."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, torch.Size)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {k: to_weights_only(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_weights_only(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    warnings.warn(
        f"{where} holds a {type(value).__name__}, which safe loading cannot restore; it is "
        "saved as its repr(). Keep trainer state to numbers, strings, tensors and containers.",
        stacklevel=2,
    )
    return repr(value)
