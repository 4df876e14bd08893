"""A tiny Hugging Face Llama and the standard tensor-parallel plan for it (attention and
MLP column-/row-wise), shared by the tensor-parallel tests."""

from __future__ import annotations

import torch
from torch import nn

from examples.tensor_parallel_plan import apply_llama_plan

__all__ = ["apply_llama_plan", "batches", "llama", "loss_of"]

VOCAB, SEQ, HIDDEN, HEADS = 96, 16, 32, 4


def llama(seed: int = 0, layers: int = 2, kv_heads: int = 2) -> nn.Module:
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return T.LlamaForCausalLM(config)


def batches(steps: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss
