"""One model with one optimizer: the pair every adapter hands to a `ZeroEngine`.

The engine shards a model together with the optimizer over its parameters, so each
framework adapter must find an optimizer's model, refuse a second pair in the words of
its own API, and give a model that is only evaluated a stand-in optimizer. These are the
same three steps in Lightning, Fabric and Accelerate.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def one_optimizer_message(who: str, found: str, alternative: str = "") -> str:
    """The error for a late optimizer or a second model: `who` shards (e.g. "The ZeRO
    strategy"), `found` says what the user did in their framework's words, `alternative`
    a fix besides the common one. One wording, so a user of any adapter reads the same
    rule and the same fix."""
    message = (
        f"{who} shards one model together with its optimizers, but {found}. Hand it the "
        "model and every optimizer over it at once (several are fine: each steps on its "
        "own)"
    )
    return f"{message}, or {alternative}." if alternative else f"{message}."


def model_of(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> nn.Module | None:
    """The first of `models` that owns every parameter of `optimizer`, or None: frameworks
    take models and optimizers in separate lists (or calls), and the engine needs the pair.
    The caller raises, naming the call that should have brought the model."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    return None


def models_trained_by(
    optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]
) -> list[nn.Module] | None:
    """The models among `models` that hold parameters of `optimizer` (one, or several
    when it trains several models together), or None when it also holds a parameter that
    none of them has."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for model in models:
        held = wanted & {id(p) for p in model.parameters()}
        if held:
            found.append(model)
            wanted -= held
    return found if found and not wanted else None


def stand_in_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """A learning-rate-0 SGD for a model that is only evaluated (Lightning's validate or
    test, Fabric's load into a model set up without an optimizer): the engine still owns,
    and at stage 3 gathers, the parameters, and it needs an optimizer to own them with.
    Over the trainable parameters, or all of them for a fully frozen model."""
    params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    return torch.optim.SGD(params, lr=0.0)
