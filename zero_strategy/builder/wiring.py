"""Builder step 9: the engine's hooks on the user's objects.

- `optimizer.zero_grad()` (what Lightning and most loops call) and `model.zero_grad()`
  (Hugging Face's Trainer, many plain loops) are routed to the engine: at stages 2-3 the
  parameters hold no `.grad` for them to clear. Each optimizer clears its own
  parameters' gradients, the model all of them.
- A ZeroRedundancyOptimizer's own state calls raise, naming the engine's checkpoint
  (`optim/zero_redundancy.py`).
- The root's forward hooks: the engine's bookkeeping before and after every forward
  (written values adopted first, before stage 3 gathers).
- With several optimizers, `requires_grad` followed before each module's forward (a GAN's
  `toggle_optimizer`).
- At stage 3, the modules whose parameters are freed between uses gather them when read
  by name (`model_view/parameter_reads.py`).

The engine hands over what each hook calls; the returned handles undo them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model_view.parameter_reads import ParameterReads
from ..model_view.routed_zero_grad import route_zero_grad
from ..optim.zero_redundancy import refuse_state_calls
from ..units.flat_unit import FlatUnit
from ..units.module_hooks import EngineHook


@dataclass
class EngineCalls:
    """What the hooks call on the engine."""

    zero_grad: Callable[..., None]
    before_forward: Callable[[], None]
    after_forward: Callable[[Any], None]
    follow_requires_grad: Callable[[], None]
    gather_for_read: Callable[[FlatUnit], None]


def wire_model(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    units: list[FlatUnit],
    calls: EngineCalls,
    reads: ParameterReads | None,
) -> list:
    """Install the hooks (`reads`: stage 3's read faces, None at stages 0-2)."""
    for opt in optimizers:
        route_zero_grad(opt, functools.partial(calls.zero_grad, optimizer=opt))
        refuse_state_calls(opt)
    route_zero_grad(model, calls.zero_grad)
    handles = []
    if len(optimizers) > 1:
        owners = {id(p) for u in units for p in u.params}
        handles += [
            module.register_forward_pre_hook(EngineHook(lambda *_: calls.follow_requires_grad()))
            for module in model.modules()
            if any(id(p) in owners for p in module.parameters(recurse=False))
        ]
    handles += [
        model.register_forward_pre_hook(
            EngineHook(lambda *_: calls.before_forward()), prepend=True
        ),
        model.register_forward_hook(
            EngineHook(lambda _module, _args, output: calls.after_forward(output))
        ),
    ]
    if reads is not None:
        handles += reads.install(model, units, calls.gather_for_read)
    return handles
