"""The router: which experts each token goes to, with what weight, and the losses that
keep the load balanced. Computed in fp32 whatever the model's dtype (router logits at
high expert counts lose the ranking in bf16)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels import topk_route

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    weights: torch.Tensor  # fp32 [T, k]: each chosen expert's weight in the token's output
    expert_index: torch.Tensor  # int64 [T, k]: global expert ids, best first
    aux_loss: torch.Tensor  # fp32 scalar: load balancing, times its coefficient
    z_loss: torch.Tensor  # fp32 scalar: router logit size, times its coefficient


class Router(nn.Module):
    """Token-choice top-k routing over `num_experts` experts.

    - `score`: "softmax" (GShard, Mixtral) or "sigmoid" (DeepSeek-V3); weights of the
      chosen experts are renormalised to sum to 1 when `normalize`. None (the default)
      renormalises top-k for k > 1 (GShard, Mixtral) and keeps top-1's own probability
      (Switch, DeepSpeed-MoE): renormalised, a single weight is always 1 and the task loss
      would never reach the router.
    - `aux_loss_coef`: Switch/GShard load balancing, E * sum_e(f_e * P_e), with f_e the
      fraction of assignments routed to expert e and P_e its mean router probability.
    - `z_loss_coef`: ST-MoE's router z-loss, mean(logsumexp(logits)^2).
    - `jitter`: multiplicative input noise in [1 - jitter, 1 + jitter] while training.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        k: int,
        score: str = "softmax",
        normalize: bool | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        jitter: float = 0.0,
    ):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"Router score={score!r} is unknown; use one of {SCORES}.")
        if not 1 <= k <= num_experts:
            raise ValueError(
                f"MoE k={k} must be between 1 and num_experts={num_experts}: each token goes "
                "to k distinct experts."
            )
        normalize = k > 1 if normalize is None else normalize
        self.num_experts, self.k, self.score, self.normalize = num_experts, k, score, normalize
        self.aux_loss_coef, self.z_loss_coef, self.jitter = aux_loss_coef, z_loss_coef, jitter
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> Routing:
        x = tokens.to(torch.float32)
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
        logits = F.linear(x, self.gate.weight.to(torch.float32))
        if self.score == "softmax":
            # The kernel picks the experts (ties to the lower id, the same on every rank and
            # backend); the weights are taken from torch's softmax so that the task loss
            # trains the gate (the Triton kernel's outputs carry no gradient).
            _, index = topk_route(logits.detach(), self.k, self.normalize)
            probs = torch.softmax(logits, dim=-1)
        else:
            probs = torch.sigmoid(logits)
            index = torch.topk(probs.detach(), self.k, dim=-1).indices
        weights = probs.gather(-1, index)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        zero = logits.new_zeros(())
        aux = zero
        if self.aux_loss_coef and tokens.shape[0]:
            routed = F.one_hot(index, self.num_experts).sum(dim=(0, 1)).to(torch.float32)
            fraction = routed / index.numel()
            aux = self.aux_loss_coef * self.num_experts * (fraction * probs.mean(0)).sum()
        z = zero
        if self.z_loss_coef and tokens.shape[0]:
            z = self.z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return Routing(weights, index, aux, z)
