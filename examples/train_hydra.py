"""The main job configured by Hydra: `trainer/strategy=zero3` from zero_strategy's
ConfigStore entries, the rest from `examples/configs/` (lightning-hydra-template layout).

    python examples/train_hydra.py
    python examples/train_hydra.py trainer/strategy=zero2 trainer.max_steps=20

Lightning's launcher re-runs this script for rank 1 with the same Hydra overrides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zero_strategy  # noqa: F401  (registers trainer/strategy=zero1..zero3)
from examples.corpus import byte_tokens
from examples.train_lightning import ByteWindows


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed)
    torch.set_num_threads(1)
    trainer = hydra.utils.instantiate(cfg.trainer)
    model = hydra.utils.instantiate(cfg.model)
    data = DataLoader(
        ByteWindows(byte_tokens(), cfg.data.block_size), batch_size=cfg.data.batch_size
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        engine = trainer.strategy.engine
        print(f"stage {engine.config.stage}: final loss {trainer.callback_metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
