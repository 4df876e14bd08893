"""A small GPT-2-style language model (tied embeddings), used by the examples, the tests
and the benchmarks. With `n_experts` > 0 every block's MLP is a mixture of experts
(`zero_strategy.moe.MoE`), split over `ep_size` expert-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy.moe import BatchedMLP, MoE, moe_losses


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    tie_embeddings: bool = True
    # > 0: MoE MLPs with this many experts; a list gives each layer its own count (PR-MoE's
    # pyramid: more experts in later layers; 0 keeps a layer dense)
    n_experts: int | list[int] = 0
    ep_size: int | None = 1  # expert-parallel ranks (None: the strategy's expert_parallel_size)
    moe_k: int = 2  # experts per token
    moe_aux_loss_coef: float = 0.01  # load balancing, added to the loss in training
    moe_capacity_factor: float | None = None  # None: dropless
    moe_residual: bool = False  # Residual-MoE: a dense MLP beside the experts
    moe_batched: bool = False  # experts as batched [n_experts, ...] weights (BatchedMLP)

    def experts_of(self, layer: int) -> int:
        return self.n_experts[layer] if isinstance(self.n_experts, list) else self.n_experts


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation (also what meta-device materialisation calls)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class MLP(nn.Sequential):
    def __init__(self, n_embd: int):
        super().__init__(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, n_experts: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        if n_experts:
            expert = BatchedMLP(cfg.n_embd, 4 * cfg.n_embd) if cfg.moe_batched else MLP(cfg.n_embd)
            self.moe = MoE(
                cfg.n_embd,
                expert,
                n_experts,
                cfg.ep_size,
                cfg.moe_k,
                aux_loss_coef=cfg.moe_aux_loss_coef,
                capacity_factor=cfg.moe_capacity_factor,
                use_residual=cfg.moe_residual,
                expert_init=init_weights,
            )
        else:
            self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
            self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if hasattr(self, "moe"):
            return x + self.moe(self.ln2(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, cfg.experts_of(i)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        experts = {id(m) for b in self.blocks if hasattr(b, "moe") for m in b.moe.experts.modules()}
        # Experts initialise themselves, by global expert id (any ep_size, same experts).
        self.apply(lambda m: None if id(m) in experts else init_weights(m))

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if self.training and any(hasattr(b, "moe") for b in self.blocks):
            loss = loss + moe_losses(self)
        return loss


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """The usual two groups: weight decay on matrices, none on biases, norms, embeddings."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and "wpe" not in name else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
