"""Loss scaling for fp16: scale up before backward, skip the step on overflow.

The overflow decision must be the same on every rank (a rank that steps while another
skips would leave the shards inconsistent), so the engine all-reduces the local inf/nan
flag before calling `update`.
"""

from __future__ import annotations

from ..config import ZeroConfig


class LossScaler:
    """Dynamic (or fixed) loss scale, DeepSpeed/apex style: halve on overflow, double
    after `window` clean steps, never below `min_scale`."""

    def __init__(self, config: ZeroConfig):
        self.enabled = config.uses_loss_scaling
        self.dynamic = str(config.loss_scale) == "dynamic"
        self.scale = (
            (
                float(2**config.initial_loss_scale_power)
                if self.dynamic
                else float(config.loss_scale)
            )
            if self.enabled
            else 1.0
        )
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.window == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
