"""LoRA fine-tuning at stage 3 with Hugging Face's Trainer: `ZeroTrainer` in place of
`Trainer`, a PEFT model with gradient checkpointing, the adapter saved whole.

    torchrun --nproc_per_node 2 examples/finetune_lora.py             # 2 CPU processes
    torchrun --nproc_per_node 2 examples/finetune_lora.py --model NAME # a Hub model

Each rank holds 1/N of the adapter's optimizer state and gradients and none for the
frozen base. `save_model()` writes `adapter_model.safetensors`, gathered from the
adapter's units alone, which `PeftModel.from_pretrained` loads in one plain process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.corpus import stdlib_text
from examples.tiny_pretrained import write_tiny_pretrained


def main() -> None:
    import peft
    import transformers

    from zero_strategy.integrations.accelerate import ZeroPlugin
    from zero_strategy.integrations.transformers import ZeroTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a Hub name or path (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--out", default="runs/lora")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or write_tiny_pretrained(Path(args.out) / "base")

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    lines = [line for line in stdlib_text().splitlines() if len(line) > 40][:512]
    rows = [
        {"input_ids": ids, "labels": ids}
        for ids in tokenizer(lines, max_length=64, truncation=True, padding="max_length")[
            "input_ids"
        ]
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    training = transformers.TrainingArguments(
        args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = ZeroTrainer(
        model=model,
        args=training,
        train_dataset=rows,
        zero_plugin=ZeroPlugin(stage=args.stage),
    )
    trainer.train()
    report = trainer.zero_engine.memory_report()
    trainer.save_model(Path(args.out) / "adapter")  # collective: every rank
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        print(
            f"rank 0 holds {report['optimizer_state']:,} B of optimizer state and "
            f"{report['gradients']:,} B of gradients for "
            f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} adapter "
            "elements"
        )
        base = transformers.AutoModelForCausalLM.from_pretrained(path)
        loaded = peft.PeftModel.from_pretrained(base, Path(args.out) / "adapter")
        print(f"adapter saved to {args.out}/adapter; loaded: {type(loaded).__name__}")
    trainer.accelerator.end_training()  # engines closed, process groups destroyed


if __name__ == "__main__":
    main()
