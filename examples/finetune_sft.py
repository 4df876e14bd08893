"""Supervised fine-tuning with TRL's `SFTTrainer` at stage 3, by one line:
`with_zero(SFTTrainer)`. The model is named by path (or Hub name): it is built on the
meta device and each rank reads only its shards' ranges of the safetensors.

    torchrun --nproc_per_node 2 examples/finetune_sft.py             # 2 CPU processes
    torchrun --nproc_per_node 2 examples/finetune_sft.py --model NAME # a Hub model
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
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    from zero_strategy.integrations.accelerate import ZeroPlugin
    from zero_strategy.integrations.transformers import with_zero

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a Hub name or path (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--out", default="runs/sft")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or write_tiny_pretrained(Path(args.out) / "base")

    lines = [line for line in stdlib_text().splitlines() if len(line) > 40][:512]
    config = SFTConfig(
        args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_length=64,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = with_zero(SFTTrainer)(  # was: SFTTrainer(
        model=path,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": lines}),
        processing_class=transformers.AutoTokenizer.from_pretrained(path),
        zero_plugin=ZeroPlugin(stage=args.stage),
    )
    trainer.train()
    trainer.save_model(Path(args.out) / "model")  # consolidated, from_pretrained loads it
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; model saved to {args.out}/model")
    trainer.accelerator.end_training()  # engines closed, process groups destroyed


if __name__ == "__main__":
    main()
