"""Where a Lightning checkpoint's model state goes when a callback moves it.

Under an engine the strategy hands Lightning an empty `EngineModelState` as the model's
state dict: the engine saves the model from its shards, in bounded memory. Lightning's
`WeightAveraging` (EMA, SWA-style averaging) moves the checkpoint's "state_dict" to
"current_model_state" and puts its averaged weights in its place, so that
`load_from_checkpoint` gives the averaged model; a resume loads "state_dict" into the
model, the averaged weights into its copy, and the live ones back from
"current_model_state". The marker follows such a move: the engine's model is saved under
the key the marker went to, what the callback put under "state_dict" is saved as it is,
and a resume hands the callback the model's state under that key again. A checkpoint
whose "state_dict" nobody touched is saved and loaded as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

# Client-state key naming where the model went (absent: "state_dict").
MODEL_AT = "zero_strategy_model_at"
# Where the model goes when a callback replaced "state_dict" and kept no marker.
OWN_KEY = "zero_strategy_model"


class EngineModelState(dict):
    """Empty: the model is in the engine's shards. Found by identity, wherever a callback
    put it."""


def model_key(checkpoint: Mapping[str, Any]) -> str:
    """The key the engine's model is saved under: where the marker is now ("state_dict"
    unless a callback moved it), or `OWN_KEY` where a callback replaced it outright."""
    for key, value in checkpoint.items():
        if isinstance(value, EngineModelState):
            return key
    return OWN_KEY


def for_saving(checkpoint: Mapping[str, Any], key: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """What the engine leaves out of the client state (the model's key and the optimizer
    states, which it saves itself), and the entries to add (where the model went)."""
    added = {} if key == "state_dict" else {MODEL_AT: key}
    return (key, "optimizer_states"), added


def after_loading(client: dict[str, Any], module: nn.Module) -> None:
    """The client state Lightning restores from, completed in place: the model's state
    under the key a callback moved it to (read from `module`, into which the engine just
    loaded it), and "state_dict" as the callback left it, or the marker."""
    key = client.pop(MODEL_AT, "state_dict")
    if key not in ("state_dict", OWN_KEY):
        client[key] = _state_copy(module)
    client.setdefault("state_dict", EngineModelState())


def _state_copy(module: nn.Module) -> dict[str, Any]:
    """`module.state_dict()` with nothing shared with the module: at stages 1-2 its entries
    are the parameters themselves, which loading "state_dict" next would overwrite (stage
    3's are copies already)."""
    own = {
        t.untyped_storage().data_ptr()
        for t in itertools.chain(module.parameters(), module.buffers())
    }
    return {
        name: value.clone()
        if isinstance(value, Tensor) and value.untyped_storage().data_ptr() in own
        else value
        for name, value in module.state_dict().items()
    }
