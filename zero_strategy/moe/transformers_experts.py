"""Hugging Face Transformers MoE models, made expert-parallel without touching their code.

Transformers 5 stores most MoE families' experts as 3-D weights (`[num_experts, ...]`) in
an `*Experts` module decorated by `use_experts_implementation`, whose forward
`(hidden_states, top_k_index, top_k_weights)` dispatches through `ALL_EXPERTS_FUNCTIONS`
by `config._experts_implementation`. That registry is the public hook used here:

- `convert` keeps this rank's `num_experts / ep_size` rows of every expert weight (sliced
  from rank 0's weights, or built on the meta device for a model that is) and points the
  module at the `zero_expert_parallel` implementation through a config of its own;
- that implementation sends each (token, expert) pair to the rank holding the expert by
  all-to-all, runs the model's own implementation (eager, grouped_mm, ...) on the local
  experts, brings the outputs back and weights them as the model would. The router, its
  auxiliary loss and everything outside the experts stay the model's.

An MoE whose experts are not in that form (per-expert module lists, other layouts) cannot
be split here and is refused by name rather than left replicated (`unconvertible`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from ..comm.communicator import Communicator
from ..layout.partition import Stored
from ..layout.shard_spec import within
from ..private_api import (
    experts_implementation,
    is_hf_experts_module,
    select_experts_implementation,
)
from . import dispatch
from .experts import batched_rows

IMPLEMENTATION = "zero_expert_parallel"
_ATTRIBUTE = "zero_expert_parallel"  # the TransformersExperts of a converted module


def is_convertible(module: nn.Module) -> bool:
    """An experts module in Transformers' 3-D form: decorated by
    `use_experts_implementation` (which sets `_is_expert_parallel`), with `num_experts`."""
    return (
        is_hf_experts_module(module)
        and hasattr(getattr(type(module), "forward", None), "__wrapped__")
        and isinstance(getattr(module, "num_experts", None), int)
        and hasattr(module, "config")
    )


class TransformersExperts:
    """One converted experts module, as the engine sees it: `ep_size` ranks each hold
    `num_local` of its `num_experts` experts; `bind` gives it its expert-parallel group."""

    def __init__(self, module: nn.Module, num_experts: int, ep_size: int, inner: str):
        self.module_type = type(module).__name__
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local = num_experts // ep_size
        self.inner = inner  # the model's own implementation, run on the local experts
        self._original_forward = type(module).forward.__wrapped__
        self.comm: Communicator | None = None

    def __deepcopy__(self, memo: dict) -> TransformersExperts:
        """A copy of the module (an EMA copy) holds the same experts: same group."""
        return self

    def bind(self, comm: Communicator) -> None:
        if comm.size != self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} got a group of {comm.size} ranks.")
        self.comm = comm
        dispatch.keep_exchanges_out_of_graphs()

    def stored_expert(self, local_name: str, ep_rank: int, shape: tuple[int, ...]) -> Stored:
        """Rows `ep_rank * num_local ...` of the whole `[num_experts, ...]` weight, under
        the module's own name: checkpoints hold the model's original layout."""
        return batched_rows(local_name, shape, self.num_experts, ep_rank)

    def forward(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        if self.comm is None:
            raise RuntimeError(
                f"{self.module_type} was made expert-parallel but has no expert-parallel "
                "group: run the model through the ZeroEngine (or strategy) that converted it."
            )
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        k = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        order = torch.sort(ids, stable=True).indices  # (token, slot) pairs by global expert
        rows = hidden_states.index_select(0, order // k)
        per_expert = torch.bincount(ids, minlength=self.num_experts)
        received, out_splits, in_splits, counts = dispatch.exchange(
            rows, per_expert, self.comm, self.num_local
        )
        chunks, regrouped = dispatch.by_expert(received, counts)
        grouped = torch.cat(chunks)
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=grouped.device), counts.sum(0).to(grouped.device)
        )
        unit_weights = torch.ones(
            grouped.shape[0], 1, dtype=top_k_weights.dtype, device=grouped.device
        )
        run = ALL_EXPERTS_FUNCTIONS.get_interface(self.inner, self._original_forward)
        out = run(module, grouped, local_ids[:, None], unit_weights)  # each row its expert's
        if grouped.shape[0] == 0 and torch.is_grad_enabled():
            # No row came here: an implementation may return a constant (eager returns
            # zeros_like), which would skip this rank's all-to-all backwards while the
            # other ranks wait in theirs. Keep the (empty) path to the rows in the graph.
            out = out + grouped * 0
        back = out.index_select(0, _inverse(regrouped))
        sent_back = dispatch.combine(back, self.comm, out_splits, in_splits)
        per_slot = sent_back.index_select(0, _inverse(order))
        weighted = per_slot.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=-2).to(hidden_states.dtype)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(permutation)
    out[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return out


def _expert_parallel_forward(module, hidden_states, top_k_index, top_k_weights):
    layer = getattr(module, _ATTRIBUTE, None)
    if layer is None:
        raise RuntimeError(
            f"{type(module).__name__} uses experts_implementation={IMPLEMENTATION!r}, which "
            "only modules converted by zero-strategy's expert parallelism can run."
        )
    return layer.forward(module, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _expert_parallel_forward)


def converted(model: nn.Module) -> dict[str, TransformersExperts]:
    """Converted experts modules by path."""
    return {
        path: layer
        for path, module in model.named_modules()
        if (layer := getattr(module, _ATTRIBUTE, None)) is not None
    }


def convertible(model: nn.Module) -> dict[str, nn.Module]:
    return {
        path: m
        for path, m in model.named_modules()
        if is_convertible(m) and getattr(m, _ATTRIBUTE, None) is None
    }


def convert(
    path: str, module: nn.Module, ep_size: int, ep_rank: int
) -> dict[int, nn.Parameter | None]:
    """Keep this rank's experts of `module` (rows `ep_rank * num_local ...` of each weight,
    rank 0's values when the weights are real) and route its forward through the
    expert-parallel implementation. Returns the replaced parameters by id."""
    num_experts = module.num_experts
    if num_experts % ep_size:
        raise ValueError(
            f"expert_parallel_size={ep_size} does not divide the num_experts={num_experts} of "
            f"'{path}' ({type(module).__name__}): each expert-parallel rank holds the same "
            "number of experts. Choose a divisor of the expert count."
        )
    per_expert = [
        (name, p)
        for name, p in module.named_parameters()
        if p.dim() >= 1 and p.shape[0] == num_experts and "." not in name
    ]
    others = sorted({name for name, _ in module.named_parameters()} - {n for n, _ in per_expert})
    if others:
        raise ValueError(
            f"Cannot make '{path}' ({type(module).__name__}) expert-parallel: its parameters "
            f"{others} are not per-expert weights [num_experts={num_experts}, ...], so they "
            "would be split wrongly. Use expert_parallel_size=1 (experts sharded by ZeRO "
            "like any weight) for this model."
        )
    _register()
    num_local = num_experts // ep_size
    start = ep_rank * num_local
    distributed = dist.is_available() and dist.is_initialized()
    replaced: dict[int, nn.Parameter | None] = {}
    for name, old in per_expert:
        if old.is_meta:
            data = torch.empty((num_local, *old.shape[1:]), dtype=old.dtype, device="meta")
        else:
            with torch.no_grad():
                if distributed:  # every rank starts from rank 0's experts, as DDP would
                    dist.broadcast(old.data, src=0)
                data = old.detach()[start : start + num_local].clone()
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        setattr(module, name, new)
        replaced[id(old)] = new
    layer = TransformersExperts(
        module, num_experts, ep_size, experts_implementation(module.config) or "eager"
    )
    config = copy.copy(module.config)  # the model's own config keeps its implementation
    select_experts_implementation(config, IMPLEMENTATION)
    module.config = config
    module.num_experts = num_local  # what the inner implementation sees: local experts
    setattr(module, _ATTRIBUTE, layer)
    return replaced


def unconvertible(model: nn.Module, known: list[str]) -> list[str]:
    """Modules that look like experts ("Expert" in the class name, or named `experts`)
    with parameters and no known expert layer (`known`: their paths)
    inside them or around them: the outermost of each. A shared expert (Aria's
    `AriaSharedExpertsMLP`, "shared" in its class or attribute name) is not one: every
    token runs through it, a dense layer that ZeRO shards as any other."""
    found: list[str] = []
    for path, module in model.named_modules():
        name, kind = path.rsplit(".", 1)[-1], type(module).__name__.lower()
        looks = ("expert" in kind or name == "experts") and "shared" not in kind + name.lower()
        if not path or not looks or any(within(path, f) for f in found):
            continue
        if any(within(k, path) or within(path, k) for k in known):
            continue
        if next(module.parameters(), None) is not None:
            found.append(path)
    return found
