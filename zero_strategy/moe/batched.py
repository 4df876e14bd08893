"""Experts held as batched weights: one tensor per weight, its first dimension the expert
(the layout of Transformers' MoE families and of grouped-GEMM kernels), instead of one
module per expert.

A batched expert module says `batched = True` and implements `with_count(count)` (a new,
uninitialised module holding `count` experts), `reset_expert(i)` (initialise expert i's
rows from the global RNG) and `forward(chunks)` (one chunk of rows per expert, in order).
Expert-parallel ranks hold a slice of the experts; checkpoints store the whole
`[num_experts, ...]` tensor, each rank writing its rows."""

from __future__ import annotations

import torch
from torch import nn


class BatchedMLP(nn.Module):
    """`num_experts` two-layer MLPs, `h -> ffn -> h`, in four batched tensors."""

    batched = True

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int = 1,
        activation: nn.Module | None = None,
        init_std: float = 0.02,
        initialise: bool = True,
    ):
        super().__init__()
        self.hidden_size, self.ffn_size, self.init_std = hidden_size, ffn_size, init_std
        self.activation = activation if activation is not None else nn.GELU()
        e, h, f = num_experts, hidden_size, ffn_size
        self.w_in = nn.Parameter(torch.empty(e, h, f))
        self.b_in = nn.Parameter(torch.empty(e, f))
        self.w_out = nn.Parameter(torch.empty(e, f, h))
        self.b_out = nn.Parameter(torch.empty(e, h))
        if initialise:
            for i in range(e):
                self.reset_expert(i)

    def with_count(self, count: int) -> BatchedMLP:
        """A new module of `count` experts, uninitialised (no RNG drawn: the caller seeds
        each expert)."""
        with torch.device(self.w_in.device):
            return BatchedMLP(
                self.hidden_size, self.ffn_size, count, self.activation, self.init_std, False
            )

    @torch.no_grad()
    def reset_expert(self, i: int) -> None:
        """GPT-2's initialisation of expert i's rows."""
        nn.init.normal_(self.w_in[i], std=self.init_std)
        nn.init.zeros_(self.b_in[i])
        nn.init.normal_(self.w_out[i], std=self.init_std)
        nn.init.zeros_(self.b_out[i])

    def forward(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        return [
            self.activation(x @ self.w_in[e] + self.b_in[e]) @ self.w_out[e] + self.b_out[e]
            for e, x in enumerate(chunks)
        ]
