"""PR-MoE (pyramid-residual MoE) from a per-layer spec: dense layers, MoE layers and
residual MoE layers with different expert counts in one model, trained expert-parallel at
stages 1 and 3 as one process trains it, and reloaded at another expert-parallel size."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distributed import run_world
from examples.gpt import GPT, GPTConfig, parse_layers
from training import local_batch, make_optimizer, rel_l2
from zero_strategy import ZeroConfig, ZeroEngine

SPEC = GPTConfig(
    vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, layers="dense moe:2 residual:4"
)
STEPS = 4


def model(ep_size: int | None, cfg: GPTConfig = SPEC) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(cfg, ep_size=ep_size))


def one_process(world: int, cfg: GPTConfig = SPEC):
    net = model(1, cfg)
    opt = make_optimizer(net)
    losses = []
    for step in range(STEPS):
        loss = sum(net(*local_batch(step, 0, r, world, cfg)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(rank, world, stage, steps, checkpoint=None, load=False, save=False, ep_size=2, cfg=SPEC):
    net = model(None, cfg)
    engine = ZeroEngine(
        net, make_optimizer(net), ZeroConfig(stage=stage, expert_parallel_size=ep_size)
    )
    if load:
        engine.load_checkpoint(checkpoint)
    losses = []
    for step in steps:
        loss = engine(*local_batch(step, 0, rank, world, cfg))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    if save:
        engine.save_checkpoint(checkpoint)
    held = [b.moe.num_local for b in net.blocks if hasattr(b, "moe")]
    return losses, engine.full_state_dict(), held


def test_the_spec_builds_each_kind_of_layer_and_refuses_typos():
    assert parse_layers("dense, moe:4 2*residual:8") == [
        (0, False),
        (4, False),
        (8, True),
        (8, True),
    ]
    net = model(1)
    assert not hasattr(net.blocks[0], "moe")
    assert net.blocks[1].moe.num_experts == 2 and not hasattr(net.blocks[1].moe, "residual_mlp")
    assert net.blocks[2].moe.num_experts == 4 and hasattr(net.blocks[2].moe, "residual_mlp")
    with pytest.raises(ValueError, match="'moe4' is not"):
        parse_layers("dense moe4")
    with pytest.raises(ValueError, match="describes 2 layers but n_layer=3"):
        replace(SPEC, layers="dense moe:2")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pr_moe_trains_as_one_process(stage):
    want, want_state = one_process(2)
    (losses, state, held), _ = run_world(_train, 2, stage, range(STEPS))
    assert held == [1, 2]  # half of 2 and of 4 experts
    assert losses == pytest.approx(want, rel=1e-5)
    assert state.keys() == want_state.keys()  # every expert under its global id
    assert rel_l2(state, want_state) <= 1e-5


def test_pr_moe_checkpoint_continues_at_another_expert_parallel_size(tmp_path):
    """Saved at ep 2, stage 3; resumed at ep 1, stage 1 (balancing loss off: the
    objective itself is per rank's batch, and the ranks' batches stay the same)."""
    cfg = replace(SPEC, moe_aux_loss_coef=0.0)
    checkpoint = str(tmp_path / "checkpoint")
    full = run_world(_train, 2, 3, range(STEPS), cfg=cfg)[0][0]
    saved = run_world(_train, 2, 3, range(2), checkpoint, False, True, cfg=cfg)[0][1]
    resumed = run_world(_train, 2, 1, range(2, STEPS), checkpoint, True, False, 1, cfg)[0][0]
    assert resumed == pytest.approx(full[2:], rel=1e-5)
    # Consolidated: every expert of every layer under its global id, the one-process
    # model's names, the saved values.
    from safetensors.torch import load_file

    from zero_strategy.checkpoint.consolidate import consolidate

    consolidate(checkpoint, tmp_path / "model", show_progress=False)
    state = load_file(str(tmp_path / "model" / "model.safetensors"))
    missing, unexpected = model(1, cfg).load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte
    assert all(torch.equal(state[k], saved[k]) for k in state)
