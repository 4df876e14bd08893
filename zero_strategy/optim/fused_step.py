"""The optimizer step through the fused kernels, for Adam and AdamW on CUDA.

The user's optimizer object stays the source of truth: its param groups (lr from
schedulers, betas, eps, weight decay) are read every step, and its `state` holds exp_avg,
exp_avg_sq and step in torch's own layout, so checkpoints and `optimizer.state_dict()` are
unchanged. Only the update runs differently: one Triton launch per param group over all of
this rank's shards, writing the bf16/fp16 compute copy in the same pass.

It applies when the kernel backend picks Triton for the masters (CUDA, or tests forcing the
interpreter), the optimizer is exactly torch.optim.Adam or AdamW, and nothing asks for
behaviour the kernel does not have (amsgrad, capturable, differentiable, tensor lr, step
hooks of the user's). Otherwise the engine calls `optimizer.step()`, torch's own fused or
foreach path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import fused_adamw_, use_triton
from ..private_api import has_user_step_hooks, mark_stepped

ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
# (master view, gradient view, compute copy) per optimizer param of a group; the copy is
# None for every param when the compute dtype is fp32 (the master is the parameter).
Views = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


class FusedAdamStep:
    def __init__(self, optimizer: torch.optim.Optimizer, own_hooks: int):
        self.optimizer = optimizer
        self.own_hooks = own_hooks  # step hooks the engine itself registered
        self.launches = 0  # kernel calls so far (one per param group per step)

    def applies(self, masters: Sequence[torch.Tensor]) -> bool:
        opt = self.optimizer
        if type(opt) not in ADAM_FAMILY or not masters or not use_triton(*masters):
            return False
        if has_user_step_hooks(opt, self.own_hooks):
            return False  # the user's hooks run only through optimizer.step()
        for group in opt.param_groups:
            if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
                return False
            if isinstance(group["lr"], torch.Tensor):
                return False
        return True

    @torch.no_grad()
    def step(
        self,
        params_by_group: Sequence[Sequence[torch.Tensor]],
        views_by_group: Sequence[Views],
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Update the masters (and compute copies) of `params_by_group`, each group's
        params the kernel steps (all of them, or those not stepped by parts), in place."""
        opt = self.optimizer
        for group, params, views in zip(opt.param_groups, params_by_group, views_by_group):
            if not views:
                continue
            steps = [self._state(p)["step"] for p in params]
            copies = [c for _, _, c in views]
            self.launches += 1
            fused_adamw_(
                [m for m, _, _ in views],
                [g for _, g, _ in views],
                [opt.state[p]["exp_avg"] for p in params],
                [opt.state[p]["exp_avg_sq"] for p in params],
                step=steps[0],
                lr=float(group["lr"]),
                betas=tuple(group["betas"]),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw=_decoupled(opt, group),
                maximize=group.get("maximize", False),
                found_inf=found_inf,
                compute_copies=None if copies[0] is None else copies,
            )
            for other in steps[1:]:
                other.copy_(steps[0])
        mark_stepped(opt)

    def _state(self, p: torch.Tensor) -> dict:
        """torch's Adam state for `p`, created or moved to the device the kernel reads it on
        (like torch's own fused Adam, the step count lives on the device)."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        return state


def _decoupled(opt: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))


def build(optimizer: torch.optim.Optimizer, own_hooks: int) -> FusedAdamStep | None:
    """A fused step for `optimizer` when it is of the Adam family, else None."""
    return FusedAdamStep(optimizer, own_hooks) if type(optimizer) in ADAM_FAMILY else None
