"""`MoE`: a mixture-of-experts layer, a drop-in for a transformer block's MLP.

    moe = MoE(hidden_size=256, expert=MLP(256), num_experts=8, ep_size=2, k=2)
    y = moe(x)                       # [..., hidden] -> [..., hidden]
    loss = task_loss + moe_losses(model)

With `ep_size` > 1 the experts are split over an expert-parallel group of contiguous
ranks, each holding `num_experts / ep_size` of them; tokens travel to their experts by
all-to-all. `ZeroEngine` builds the groups: it binds each layer to its expert-parallel
group and shards the experts over their expert-data-parallel group (the ranks holding
the same experts) at every stage, while the router and the rest of the model are sharded
over the whole world. Routing is dropless: every token reaches its k experts, with no
padding to the busiest one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..kernels import permute, unpermute
from ..layout.partition import Stored
from . import capacity, dispatch
from .experts import Experts, batched_rows
from .router import Router


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int,
        ep_size: int | None = 1,
        k: int = 1,
        *,
        score: str = "softmax",
        normalize: bool | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        jitter: float = 0.0,
        capacity_factor: float | None = None,
        eval_capacity_factor: float | None = None,
        min_capacity: int = 4,
        random_token_selection: bool = False,
        use_residual: bool = False,
        expert_init: Callable[[nn.Module], None] | None = None,
    ):
        """`expert_init(submodule)` initialises each expert copy (default: the
        submodules' `reset_parameters()`), under a seed of its global expert id.

        `capacity_factor` None is dropless; a number caps each expert at
        `capacity_for(tokens, k, num_experts, factor, min_capacity)` of this rank's
        assignments and drops the rest (their output is zero: the block's residual
        stream carries the token). `eval_capacity_factor` replaces it in evaluation
        (default: the same). `random_token_selection` (top-1 with a capacity) lets tokens
        compete for capacity in random order while training. `use_residual` is
        Residual-MoE: a dense copy of `expert` beside the experts, mixed in by a learned
        per-token coefficient (`out = moe * c0 + mlp * c1`, `c = softmax(Linear(h, 2))`).
        """
        super().__init__()
        if num_experts <= 0 or (ep_size is not None and (ep_size <= 0 or num_experts % ep_size)):
            raise ValueError(
                f"MoE num_experts={num_experts} must be a positive multiple of "
                f"ep_size={ep_size}: each expert-parallel rank holds the same number of "
                "experts. Change one of them."
            )
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(
                f"MoE capacity_factor={capacity_factor} must be positive (or None: dropless)."
            )
        if random_token_selection and k != 1:
            raise ValueError(
                f"MoE random_token_selection applies to top-1 routing, got k={k}; drop it or "
                "use k=1."
            )
        # ep_size None: ZeroEngine decides (ZeroConfig.expert_parallel_size); until then
        # this rank holds every expert.
        self.hidden_size, self.num_experts, self.ep_size = hidden_size, num_experts, ep_size
        self.num_local = num_experts // (ep_size or 1)
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = (
            capacity_factor if eval_capacity_factor is None else eval_capacity_factor
        )
        self.min_capacity, self.random_token_selection = min_capacity, random_token_selection
        self.router = Router(
            hidden_size, num_experts, k, score, normalize, aux_loss_coef, z_loss_coef, jitter
        )
        # One draw from the global RNG whatever ep_size is: the experts' seeds, so the same
        # seed gives the same experts at every expert-parallel size.
        seed = int(torch.randint(2**40, (), device="cpu").item())
        if use_residual:
            self.residual_mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.experts = Experts(expert, self.num_local, seed, expert_init)
        self._comm: Communicator | None = None
        self.last_losses: torch.Tensor | None = None  # aux + z of the last training forward

    # ------------------------------------------------------------------ groups
    def settle_ep_size(self, ep_size: int, ep_rank: int) -> dict[int, nn.Parameter | None]:
        """For a layer built with ep_size=None: split the experts over `ep_size` ranks,
        keeping this rank's (`ep_rank` in its group); returns the replaced parameters
        (`Experts.keep`)."""
        if self.ep_size is not None:
            return {}
        if self.num_experts % ep_size:
            raise ValueError(
                f"expert_parallel_size={ep_size} does not divide this MoE layer's "
                f"num_experts={self.num_experts}: each expert-parallel rank holds the same "
                "number of experts. Choose a divisor of the expert count."
            )
        self.ep_size, self.num_local = ep_size, self.num_experts // ep_size
        return self.experts.keep(ep_rank * self.num_local, self.num_local)

    def bind(self, comm: Communicator) -> None:
        """Set the expert-parallel group (ZeroEngine does, with its own groups, before it
        materialises the model): this rank then holds experts rank * num_local, ..."""
        if comm.size != self.ep_size:
            raise ValueError(f"MoE ep_size={self.ep_size} got a group of {comm.size} ranks.")
        self._comm = comm
        dispatch.keep_exchanges_out_of_graphs()
        self.experts.assign(comm.rank * self.num_local)

    def stored_expert(self, local_name: str, ep_rank: int, shape: tuple[int, ...]) -> Stored:
        """Where expert-parallel rank `ep_rank`'s parameter `local_name` (a name under
        `self.experts`) is stored: `local.<i>.<rest>` as `local.<global id>.<rest>`, so
        checkpoints hold experts by global id; a batched weight `[num_local, ...]` as
        its rows of one `[num_experts, ...]` tensor."""
        if self.experts.batched:
            return batched_rows(local_name, shape, self.num_experts, ep_rank)
        head, index, rest = local_name.split(".", 2)
        return Stored(f"{head}.{ep_rank * self.num_local + int(index)}.{rest}", tuple(shape))

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE expects inputs of hidden size {self.hidden_size}, got {tuple(hidden.shape)}."
            )
        tokens = hidden.reshape(-1, self.hidden_size)
        routing = self.router(tokens)
        if self.training and torch.is_grad_enabled():
            self.last_losses = routing.aux_loss + routing.z_loss
        plan = capacity.plan(
            routing.expert_index,
            self.num_experts,
            self._capacity(tokens.shape[0]),
            self._shuffle() if self.random_token_selection and self.training else None,
        )
        rows = permute(tokens, plan)  # grouped by global expert
        if (self.ep_size or 1) == 1:
            chunks = list(rows.split(plan.kept_per_expert.tolist()))
            out = torch.cat(self.experts(chunks)) if chunks else rows
        else:
            out = self._expert_parallel(rows, plan.kept_per_expert)
        y = unpermute(out, plan, routing.weights)
        if hasattr(self, "residual_mlp"):
            mix = torch.softmax(self.coefficient(tokens).to(torch.float32), dim=-1)
            y = y * mix[:, :1] + self.residual_mlp(tokens).to(torch.float32) * mix[:, 1:]
        return y.to(hidden.dtype).reshape(hidden.shape)

    def _capacity(self, tokens: int) -> int | None:
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if factor is None:
            return None
        return capacity.capacity_for(
            tokens, self.router.k, self.num_experts, factor, self.min_capacity
        )

    def _shuffle(self) -> torch.Generator:
        """A generator drawn from the global RNG: seeded runs select reproducibly."""
        return torch.Generator().manual_seed(int(torch.randint(2**62, ()).item()))

    def _expert_parallel(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        comm = self._comm
        if comm is None:
            raise RuntimeError(
                f"MoE with ep_size={self.ep_size} has no expert-parallel group: hand the model "
                "to ZeroEngine (or a zero-strategy Trainer/Fabric/Accelerate strategy), which "
                "creates the groups, before running it."
            )
        received, out_splits, in_splits, counts = dispatch.exchange(
            rows, per_expert, comm, self.num_local
        )
        chunks, order = dispatch.by_expert(received, counts)
        outputs = torch.cat(self.experts(chunks))
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        back = outputs.index_select(0, restore)
        return dispatch.combine(back, comm, out_splits, in_splits)


def moe_losses(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's router losses from its last training forward (add it
    to the task loss); zero when there are none."""
    losses = [
        m.last_losses for m in model.modules() if isinstance(m, MoE) and m.last_losses is not None
    ]
    return torch.stack(losses).sum() if losses else torch.zeros(())
