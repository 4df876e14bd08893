"""Sharded exponential moving average of the weights.

An EMA of the model is usually a second full copy on every rank (Lightning's
`EMAWeightAveraging`, timm's `ModelEmaV3`). Here each rank keeps the average of its own
fp32 master shard only: 1/N of a copy. It lives in the optimizer's state, next to
`exp_avg`, under the key "ema", because it is exactly that kind of state: one value per
master element, sharded and re-sharded with the masters. So the sharded checkpoints save
it and load it at any world size and stage with no format of its own, `memory_report()`
counts it, and `consolidate(..., weights="ema")` writes the averaged model.

The first update copies the weights, as `torch.optim.swa_utils.AveragedModel` does; each
later one is `ema += (1 - decay) * (master - ema)`, torch's `get_ema_avg_fn(decay)`.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from ..units.optimizer_view import OptimizerView

EMA_KEY = "ema"


class ShardedEMA:
    """The EMA of the masters behind `views` (the optimizer's shard views), held in
    `state` (the optimizer state mapping, keyed by those views)."""

    def __init__(self, views: Sequence[OptimizerView], state: MutableMapping[Any, Any]):
        self.views = views
        self.state = state

    @property
    def started(self) -> bool:
        return any(EMA_KEY in self.state.get(v.param, {}) for v in self.views)

    @torch.no_grad()
    def update(
        self,
        decay: float,
        groups: set[int] | None = None,
        views: Sequence[OptimizerView] | None = None,
    ) -> None:
        """Every weight's average, or those of the param `groups` (one optimizer's), over
        all views or `views` (the tile whose state is in memory)."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"The EMA decay must be in [0, 1), got {decay}; 0.999 is usual.")
        for view in self.views if views is None else views:
            if view.alias_of is not None:
                continue  # a later optimizer's view: the first one's holds the EMA
            if groups is not None and view.group_index not in groups:
                continue
            entry = self.state.setdefault(view.param, {})
            master = view.param.detach()
            if EMA_KEY not in entry:
                entry[EMA_KEY] = master.clone()
            else:
                entry[EMA_KEY].lerp_(master, 1.0 - decay)

    @torch.no_grad()
    def swap(self, views: Sequence[OptimizerView] | None = None) -> None:
        """Exchange the masters and the average, in place (a second swap undoes it), over
        all views or `views`."""
        if not self.started:
            raise RuntimeError(
                "There is no EMA to swap in yet: update it first (ZeroConfig(ema_decay=...) "
                "updates it after every step, or call engine.update_ema(decay))."
            )
        for view in self.views if views is None else views:
            if view.alias_of is not None:
                continue
            ema = self.state[view.param][EMA_KEY]
            master = view.param.detach()
            scratch = master.clone()
            master.copy_(ema)
            ema.copy_(scratch)
