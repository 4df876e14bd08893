"""Rebuild the user's optimizer over this rank's shards.

The user's optimizer object is kept (so that schedulers and references built on it keep
working) but its param groups are re-pointed at 1-D views of this rank's fp32 master
shard: one view per (unit, param group) segment. Class, defaults and every per-group
hyperparameter stay as the user set them.

Only optimizers whose update is elementwise are exact under this scheme (each element's
new value depends on that element alone); others are refused unless the user opts in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from .optimizer_set import OptimizerSet

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


class UnsupportedOptimizerError(TypeError):
    """The optimizer cannot be sharded exactly; the message says what to use instead."""


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}. "
            "Build one over model.parameters(), e.g. torch.optim.AdamW(model.parameters())."
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UnsupportedOptimizerError(
            "LBFGS is not supported: it re-evaluates a closure and keeps whole-model history "
            "vectors, which cannot be partitioned across ranks. Use an elementwise optimizer "
            "such as AdamW, or train LBFGS without ZeRO (strategy 'ddp')."
        )
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS and not allow_untested:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} is not known to be elementwise, so its update over a "
            f"shard may differ from its update over the whole model. Supported: {names}. If "
            "its update depends only on each element's own gradient and state, set "
            "ZeroConfig(allow_untested_optimizer=True)."
        )


def check_host_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    """The optimizer offloaded from an accelerator steps on the CPU: settings that tie
    it to the device's tensors cannot work there."""
    for optimizer in optimizers:
        for gi, group in enumerate(optimizer.param_groups):
            lr = group.get("lr")
            on_device = isinstance(lr, torch.Tensor) and lr.device.type != "cpu"
            if group.get("capturable") or on_device:
                what = (
                    "capturable=True" if group.get("capturable") else f"an lr tensor on {lr.device}"
                )
                raise UnsupportedOptimizerError(
                    f"{type(optimizer).__name__} param group {gi} has {what}, but with "
                    "offload_optimizer (or offload_params) the optimizer steps on the CPU, "
                    "over the fp32 masters in host memory. Build it without capturable (and "
                    "with a float or CPU tensor lr), or set offload_optimizer='none' and "
                    "offload_params='none'."
                )


@dataclass
class GroupsOfParams:
    """Which optimizer param groups hold each parameter (by id): its first optimizer's
    group, and the groups of later optimizers that step it too."""

    first: dict[int, int]
    later: dict[int, tuple[int, ...]]

    def drop(self, param: nn.Parameter) -> None:
        self.first.pop(id(param), None)
        self.later.pop(id(param), None)


def group_index_of_params(
    optimizer: OptimizerSet, model_params: list[nn.Parameter]
) -> GroupsOfParams:
    """Every model parameter's optimizer groups; errors on foreign params and on a
    parameter in two groups of one optimizer."""
    describe = optimizer.describe_group
    in_model = {id(p) for p in model_params}
    group_of: dict[int, int] = {}
    later_of: dict[int, tuple[int, ...]] = {}
    foreign: list[str] = []
    for k in range(len(optimizer.optimizers)):
        seen_here: dict[int, int] = {}
        for gi in optimizer.groups_of(k):
            for p in optimizer.param_groups[gi]["params"]:
                if id(p) not in in_model:
                    foreign.append(f"group {gi}: tensor of shape {tuple(p.shape)}")
                elif id(p) in seen_here:
                    first, again = describe(seen_here[id(p)]), describe(gi)
                    raise ValueError(
                        f"A parameter of shape {tuple(p.shape)} is in {first} and in "
                        f"{again}: one optimizer steps each parameter with one group's "
                        "settings (torch refuses it too). List each parameter in one group."
                    )
                else:
                    seen_here[id(p)] = gi
                    if id(p) in group_of:
                        later_of[id(p)] = (*later_of.get(id(p), ()), gi)
                    else:
                        group_of[id(p)] = gi
    if foreign:
        shown = "; ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"The optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"given to ZeroEngine ({shown}). Build the optimizer from this model's parameters, "
            "e.g. torch.optim.AdamW(model.parameters())."
        )
    return GroupsOfParams(group_of, later_of)


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, views_by_group: dict[int, list[torch.Tensor]]
) -> None:
    """Replace each group's params with this rank's master views; drop any old state."""
    for gi, group in enumerate(optimizer.param_groups):
        group["params"] = [nn.Parameter(v, requires_grad=True) for v in views_by_group.get(gi, [])]
    optimizer.state = defaultdict(dict)
