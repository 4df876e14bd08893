"""A stand-in for a Hub model, so that the fine-tuning examples need no download: a small
Llama and a byte-level tokenizer, saved as `from_pretrained` reads them (config.json,
sharded safetensors, tokenizer files). Pass `--model <hub name or path>` to the examples
to fine-tune a real one instead."""

from __future__ import annotations

from pathlib import Path

import torch


def byte_tokenizer():
    """A byte-level tokenizer: 256 byte symbols, <pad> and <eos>; no merges."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def write_tiny_pretrained(path: str | Path) -> str:
    """Write the model once (every rank may call it; the main process writes, the others
    wait), and return its path."""
    import transformers
    from accelerate import PartialState

    path = Path(path)
    state = PartialState(cpu=not torch.cuda.is_available())  # (else one process on CPU)
    if state.is_main_process and not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=258,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=0,
            eos_token_id=1,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="1MB")
        byte_tokenizer().save_pretrained(path)
    state.wait_for_everyone()
    return str(path)
