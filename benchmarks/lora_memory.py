"""Per-rank memory of a LoRA fine-tune at stages 1-3 (2 ranks, gloo): where the adapter's
optimizer state and gradients live, from `engine.memory_report()` after one step.

    python benchmarks/lora_memory.py

A tiny Llama (88,128 parameters) with LoRA r=4 on q_proj and v_proj (1,792 trainable
elements). ZeRO's promise: each rank holds 1/N of the trainable elements' state, and the
frozen base none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_world

KINDS = ("parameters", "gradients", "optimizer_state")


def _model():
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _one_step(rank, world, stage):
    from zero_strategy import ZeroConfig, ZeroEngine

    model = _model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    report = engine.memory_report()
    engine.close()
    return report


def main() -> None:
    model = _model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {trainable:,} trainable")
    print("| stage | rank | " + " | ".join(f"{k} (B)" for k in KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for stage in (1, 2, 3):
        for rank, report in enumerate(run_world(_one_step, 2, stage)):
            print(f"| {stage} | {rank} | " + " | ".join(f"{report[k]:,}" for k in KINDS) + " |")


if __name__ == "__main__":
    main()
