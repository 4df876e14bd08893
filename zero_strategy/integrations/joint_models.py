"""Several models trained together, sharded by one engine.

Accelerate's users prepare several models in one call: diffusers' DreamBooth trains a
UNet and a text encoder with one optimizer, a GAN keeps its generator and discriminator
as two modules with an optimizer each. The engine shards one module; `JointModels` is
that module, holding the models as its children. Each model stays the module the user
calls (its parameters are sharded in place) and nobody calls the container, whose names
("0.<name>", "1.<name>") are those of the engine's checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class JointModels(nn.ModuleList):
    """The models, in the order they were prepared, as one module for one engine."""

    def prefix_of(self, model: nn.Module) -> str:
        """The names of `model`'s entries in the engine's state ("1." for the second)."""
        for i, member in enumerate(self):
            if member is model:
                return f"{i}."
        raise ValueError(f"{type(model).__name__} is not one of the jointly sharded models")

    def own_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict:
        """`model`'s entries of the joint state dict, under its own names."""
        prefix = self.prefix_of(model)
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
