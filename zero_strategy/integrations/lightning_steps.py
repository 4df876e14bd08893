"""Lightning: the user's steps run inside the engine's forward bookkeeping.

A LightningModule's `training_step` runs the model through its submodules, not through
the root's forward where the engine's hooks sit. The strategy runs the engine's
`begin_step` / `after_forward` around each step instead (buffer broadcast, an outside
`zero_grad`, the root unit gathered at stage 3), as DDP's and FSDP's forward redirection
does through the root's forward. A mixin of the ZeRO strategy class: `super()` is
Lightning's `DDPStrategy`.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Iterator
from typing import Any

import torch

from zero_strategy import ZeroEngine


class StepRedirection(ABC):  # (as Strategy: the layout a DDPStrategy can change class to)
    engine: ZeroEngine | None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with self.engine.no_sync() if self.engine is not None else contextlib.nullcontext():
            yield

    def _around_forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return getattr(super(), name)(*args, **kwargs)
        self.engine.begin_step()
        output = None
        try:
            output = getattr(super(), name)(*args, **kwargs)
            return output
        finally:
            self.engine.after_forward(output)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._around_forward("training_step", *args, **kwargs)
        if self.engine is not None:  # an opt.zero_grad() in the step
            self.engine.honour_outside_zero_grad()
        return output

    def _evaluation_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._around_forward(name, *args, **kwargs)
        finally:
            if self.engine is not None and not torch.is_grad_enabled():
                self.engine.reshard()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", *args, **kwargs)
