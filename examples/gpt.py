"""A small GPT-2-style language model (tied embeddings), used by the examples, the tests
and the benchmarks. With `n_experts` > 0 every block's MLP is a mixture of experts
(`zero_strategy.moe.MoE`), split over `ep_size` expert-parallel ranks. `generate()` decodes
with a KV cache, greedy or sampled, batch > 1; under expert parallelism or stage 3 every
rank runs the same number of forwards (the longest request's), as their collectives need."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
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
    # PR-MoE's per-layer spec, which replaces n_experts and moe_residual when given: one
    # word per layer, "dense", "moe:E" or "residual:E" (E experts; residual: a dense MLP
    # beside them), e.g. "dense dense moe:4 residual:8"; "2*dense 2*residual:8" repeats.
    layers: str | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            kinds = parse_layers(self.layers)
            if len(kinds) != self.n_layer:
                raise ValueError(
                    f"GPTConfig.layers describes {len(kinds)} layers but n_layer={self.n_layer}; "
                    "give one word per layer."
                )

    def experts_of(self, layer: int) -> int:
        if self.layers is not None:
            return parse_layers(self.layers)[layer][0]
        return self.n_experts[layer] if isinstance(self.n_experts, list) else self.n_experts

    def residual_of(self, layer: int) -> bool:
        if self.layers is not None:
            return parse_layers(self.layers)[layer][1]
        return self.moe_residual


def parse_layers(spec: str) -> list[tuple[int, bool]]:
    """ "dense moe:4 2*residual:8" -> [(0, False), (4, False), (8, True), (8, True)]."""
    out: list[tuple[int, bool]] = []
    for word in spec.replace(",", " ").split():
        count, _, kind = word.rpartition("*")
        name, _, experts = kind.partition(":")
        if name == "dense" and not experts:
            layer = (0, False)
        elif name in ("moe", "residual") and experts.isdigit() and int(experts) > 0:
            layer = (int(experts), name == "residual")
        else:
            raise ValueError(
                f"Layer spec {word!r} is not 'dense', 'moe:E' or 'residual:E' (E > 0 experts), "
                "optionally repeated as 'N*...'."
            )
        out.extend([layer] * (int(count) if count else 1))
    return out


@dataclass
class LayerCache:
    """One layer's keys and values of the tokens seen so far ([batch, heads, tokens, d])."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
        self.keys, self.values = k, v
        return k, v


@dataclass
class KVCache:
    layers: list[LayerCache] = field(default_factory=list)

    @property
    def length(self) -> int:
        first = self.layers[0].keys if self.layers else None
        return 0 if first is None else first.shape[2]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        past = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        if cache is not None:
            k, v = cache.extend(k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new token i sees the past and new tokens up to i
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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
    def __init__(self, cfg: GPTConfig, n_experts: int = 0, residual: bool = False):
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
                use_residual=residual,
                expert_init=init_weights,
            )
        else:
            self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
            self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        if hasattr(self, "moe"):
            return x + self.moe(self.ln2(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.experts_of(i), cfg.residual_of(i)) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        experts = {id(m) for b in self.blocks if hasattr(b, "moe") for m in b.moe.experts.modules()}
        # Experts initialise themselves, by global expert id (any ep_size, same experts).
        self.apply(lambda m: None if id(m) in experts else init_weights(m))

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ):
        past = 0 if cache is None else cache.length
        pos = torch.arange(past, past + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if cache is not None and not cache.layers:
            cache.layers.extend(LayerCache() for _ in self.blocks)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache.layers[i])
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if self.training and any(hasattr(b, "moe") for b in self.blocks):
            loss = loss + moe_losses(self)
        return loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`idx` [batch, prompt] followed by `max_new_tokens` tokens: the most likely each
        time, or sampled (`temperature`, `top_k`, from `generator`). The prompt is run once,
        then one token at a time against the KV cache. When the model's forward is collective
        (expert parallelism, stage 3), ranks asking for fewer tokens run extra forwards on
        their last token until the longest request is done."""
        if idx.shape[1] + max_new_tokens > self.cfg.block_size:
            raise ValueError(
                f"A prompt of {idx.shape[1]} tokens plus max_new_tokens={max_new_tokens} "
                f"exceeds block_size={self.cfg.block_size}; shorten one of them."
            )
        steps = _longest_request(max_new_tokens, idx.device)
        cache = KVCache()
        logits = self(idx, cache=cache)
        out = [idx]
        for step in range(steps):
            if step < max_new_tokens:
                out.append(_pick(logits[:, -1].float(), do_sample, temperature, top_k, generator))
            if step + 1 < steps:  # past this rank's request: the same token again, discarded
                logits = self(out[-1], cache=cache if step + 1 < max_new_tokens else None)
        return torch.cat(out, 1)


def _pick(logits, do_sample, temperature, top_k, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def _longest_request(max_new_tokens: int, device: torch.device) -> int:
    """The most tokens any rank generates: every rank runs that many forwards."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return max_new_tokens
    steps = torch.tensor([max_new_tokens], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return int(steps.item())


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
