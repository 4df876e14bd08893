"""Checkpoints written before the engine's redesign still load: `fixtures/checkpoint_v1`
was written by the code of commit 4dc9600 (`fixtures/make_checkpoint_v1.py`), a tiny
GPT with a dense and an MoE block, stage 3 on 2 ranks, after 3 AdamW steps. Every later
engine loads it at any stage and world size to the bit, and goes on as the old one did."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from zero_strategy import ZeroConfig, ZeroEngine

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _batch(step: int, rank: int):
    data = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
    return data[:, :-1], data[:, 1:]


def _load(rank, world, stage):
    torch.manual_seed(1)  # other initial values than the checkpoint's: the load must replace them
    model = GPT(GPTConfig(**EXPECTED["config"]))
    engine = ZeroEngine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeroConfig(stage=stage)
    )
    try:
        engine.load_checkpoint(FIXTURE)
        full = engine.full_state_dict(rank0_only=False)
        batches = [_batch(3, r) for r in range(2)] if world == 1 else [_batch(3, rank)]
        # A training forward, as the old engine's 4th step (its MoE loss included).
        losses = [engine(x, y).item() for x, y in batches]
        return full, losses, engine.global_steps
    finally:
        engine.close()


@pytest.mark.parametrize(("world", "stage"), [(1, 0), (2, 1), (2, 2), (2, 3)])
def test_a_checkpoint_written_before_the_redesign_loads_to_the_bit(world, stage):
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    results = run_world(_load, world, stage)
    losses = [loss for _, rank_losses, _ in results for loss in rank_losses]
    for full, _, steps in results:
        assert steps == EXPECTED["step"]
        assert full.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(full[name], value), name
    mean = sum(losses) / len(losses)
    assert mean == pytest.approx(EXPECTED["mean_loss_of_step_4"], rel=1e-6)
