"""Where a Lightning checkpoint's model state goes when a callback moves it.

Under an engine the strategy hands Lightning an empty `EngineModelState` as the model's
state dict: the engine saves the model from its shards, in bounded memory. Lightning's
`WeightAveraging` (EMA, SWA-style averaging) moves the checkpoint's "state_dict" to
"current_model_state" and puts its averaged weights in its place, so that
`load_from_checkpoint` gives the averaged model; a resume loads "state_dict" into the
model, the averaged weights into its copy, and the live ones back from
"current_model_state". The marker follows such a move: the engine's model is saved under
the key the marker went to, what the callback put under "state_dict" is saved as it is,
and a resume hands the callback the model's state under that key again (the fp32
masters, gathered to every rank: the callback holds a whole averaged copy per rank
anyway). A checkpoint whose "state_dict" nobody touched is saved and loaded as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..checkpoint.one_file import MODEL_AT

# Where the model goes when a callback replaced "state_dict" and kept no marker.
OWN_KEY = "zero_strategy_model"
# Where WeightAveraging keeps the live weights (Lightning's name).
_LIVE_WEIGHTS = "current_model_state"


class EngineModelState(dict):
    """Empty: the model is in the engine's shards. Found by type among the checkpoint's
    top-level entries."""


def in_module_order(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """`state`'s entries in the order `module.state_dict()` lists them (each module's
    parameters, then its buffers, then its children's), which `engine.full_state_dict()`
    does not keep (it goes unit by unit)."""
    order: dict[str, None] = {}
    for prefix, child in module.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        named = (
            *child.named_parameters(recurse=False, remove_duplicate=False),
            *child.named_buffers(recurse=False, remove_duplicate=False),
        )
        order.update((head + name, None) for name, _ in named)
    listed = {name: state[name] for name in order if name in state}
    return {**listed, **state}  # (anything else after)


def model_key(checkpoint: Mapping[str, Any]) -> str:
    """The key the engine's model is saved under: "state_dict" while it holds the
    marker, else the top-level key a callback moved the marker to, else `OWN_KEY` (a
    callback replaced it outright)."""
    if isinstance(checkpoint.get("state_dict"), EngineModelState):
        return "state_dict"
    for key, value in checkpoint.items():
        if isinstance(value, EngineModelState):
            return key
    return OWN_KEY


def for_saving(checkpoint: Mapping[str, Any], key: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """What the engine leaves out of the client state (the model's key and the optimizer
    states, which it saves itself), and the entries to add (where the model went, which
    consolidation and the one-file writer read too)."""
    added = {} if key == "state_dict" else {MODEL_AT: key}
    return (key, "optimizer_states"), added


def after_loading(client: dict[str, Any], model_state: Callable[[], dict[str, Any]]) -> None:
    """The client state Lightning restores from, completed in place. `model_state()`:
    the model's whole fp32 state, which the engine just loaded (collective; called on
    every rank or none). Under the key a callback moved the model to, that state again;
    "state_dict" as the callback left it, or the marker. A one-file checkpoint DDP wrote
    with WeightAveraging (no `MODEL_AT`: the engine loaded its averaged "state_dict" into
    the model) gets that "state_dict" back for the callback, which reads it."""
    key = client.pop(MODEL_AT, None)
    if key is None:
        if _LIVE_WEIGHTS in client and "state_dict" not in client:
            client["state_dict"] = model_state()
    elif key != OWN_KEY:
        client[key] = model_state()
    client.setdefault("state_dict", EngineModelState())
