"""The main job: a small GPT trained with `Trainer(strategy="zero3")` on 2 CPU processes,
a sharded checkpoint written, then consolidated into one safetensors file.

    python examples/train_lightning.py                 # Lightning launches the 2 ranks
    python examples/train_lightning.py --strategy zero1 --max-steps 50
    python examples/train_lightning.py --experts 4 --expert-parallel-size 2   # MoE MLPs

The corpus is Python's standard-library docstrings, tokenised as bytes: no download.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.corpus import byte_tokens
from examples.gpt import GPT, GPTConfig, decay_groups
from zero_strategy.checkpoint.consolidate import consolidate


class ByteWindows(Dataset):
    """Fixed windows of the corpus: sample i starts at i * stride."""

    def __init__(self, tokens: torch.Tensor, block: int, stride: int = 97):
        self.tokens, self.block, self.stride = tokens, block, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.block - 1) // self.stride

    def __getitem__(self, i: int):
        chunk = self.tokens[i * self.stride : i * self.stride + self.block + 1]
        return chunk[:-1], chunk[1:]


class LitGPT(L.LightningModule):
    def __init__(self, n_layer: int = 4, n_embd: int = 128, lr: float = 3e-3, experts: int = 0):
        super().__init__()
        self.save_hyperparameters()
        # With experts, every MLP is an MoE layer whose experts the strategy splits over
        # its expert_parallel_size (ep_size=None).
        self.cfg = GPTConfig(
            vocab_size=256,
            block_size=64,
            n_layer=n_layer,
            n_head=4,
            n_embd=n_embd,
            n_experts=experts,
            ep_size=None,
        )

    def configure_model(self) -> None:
        # Runs inside the strategy's sharded context: built on the meta device, each rank
        # then materializes only its own shard.
        if not hasattr(self, "model"):
            self.model = GPT(self.cfg)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(decay_groups(self.model), lr=self.hparams.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def epochs_spanned(max_steps: int, samples: int, ranks: int, batch: int, accumulate: int) -> int:
    """The epochs that `max_steps` optimizer steps reach into. Trainer(max_steps=...) alone
    sets max_epochs=-1, and Lightning's bar then reads "Epoch 1/-2" and counts the remaining
    optimizer steps as batches ("82/41" with accumulate_grad_batches=2). As an upper bound
    it stops nothing: max_steps is reached first."""
    batches = math.ceil(math.ceil(samples / ranks) / batch)  # per rank (DistributedSampler)
    return math.ceil(max_steps / math.ceil(batches / accumulate))  # a step ends each epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero3", choices=["zero1", "zero2", "zero3", "ddp"])
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--out", default="runs/lightning")
    parser.add_argument("--experts", type=int, default=0, help="MoE MLPs with this many experts")
    parser.add_argument(
        "--expert-parallel-size", type=int, default=1, help="ranks the experts are split over"
    )
    args = parser.parse_args()

    L.seed_everything(0)
    torch.set_num_threads(1)
    windows = ByteWindows(byte_tokens(), 64)
    data = DataLoader(windows, batch_size=8, shuffle=True, num_workers=0)
    strategy = args.strategy
    if args.expert_parallel_size > 1:
        from zero_strategy.integrations.lightning import ZeroStrategy

        strategy = ZeroStrategy(
            stage=int(args.strategy[-1]), expert_parallel_size=args.expert_parallel_size
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        max_epochs=epochs_spanned(args.max_steps, len(windows), 2, 8, accumulate=2),
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        default_root_dir=args.out,
        enable_checkpointing=False,
    )
    model = LitGPT(experts=args.experts)
    trainer.fit(model, data)
    ckpt = Path(args.out) / "last.ckpt"
    # Every rank writes its shard (a directory for zero*); optimizer state included.
    trainer.save_checkpoint(ckpt, weights_only=False)
    if trainer.is_global_zero and args.strategy.startswith("zero"):
        files = consolidate(ckpt, Path(args.out) / "consolidated", show_progress=False)
        print(f"sharded checkpoint: {ckpt}/  consolidated model: {files[0]}")
        report = trainer.strategy.engine.memory_report()
        print(
            "rank 0 memory (MiB): "
            + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in report.items() if v)
        )


if __name__ == "__main__":
    main()
