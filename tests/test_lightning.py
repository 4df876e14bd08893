"""Trainer(strategy="zero1|2|3"): the same losses as DDP, resume, bad input."""

from __future__ import annotations

import os

import pytest
from lightning_helpers import fit

from distributed import run_world

L = pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def ddp_run():
    return run_world(fit, 2, "ddp")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_same_losses_as_ddp(strategy, ddp_run):
    runs = run_world(fit, 2, strategy)
    for rank, (ours, ddp) in enumerate(zip(runs, ddp_run)):
        assert ours["strategy"] == "ZeroStrategy"
        assert ours["sampler"] == "DistributedSampler"  # is_distributed
        assert len(ours["losses"]) == 40  # 20 optimizer steps x 2 micro-batches
        for i, (a, b) in enumerate(zip(ours["losses"], ddp["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, i, a, b)


def _resume_runs(tmp_path, strategy: str, accumulate: int):
    """Epochs of 5 steps; resume from the checkpoint written at the end of the first."""
    kw = dict(epoch_steps=5, accumulate=accumulate)
    full = run_world(fit, 2, strategy, 10, None, None, True, **kw)
    run_world(fit, 2, strategy, 10, str(tmp_path / strategy), None, True, **kw)
    ckpt = tmp_path / strategy / "step=5.ckpt"
    resumed = run_world(fit, 2, strategy, 10, None, str(ckpt), True, **kw)
    return full, resumed, ckpt


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_from_a_sharded_checkpoint_continues_as_ddp_does(tmp_path, accumulate):
    """Epochs of 5 steps, resumed from the checkpoint written at the end of the first.
    Lightning's own resume does not replay the uninterrupted run exactly (DDP's continued
    losses differ from its uninterrupted ones from the second batch on, with or without
    accumulation); ZeRO continues exactly as DDP does. The engine's checkpoints themselves
    resume bit for bit (tests/test_checkpoint.py)."""
    _, ddp, _ = _resume_runs(tmp_path, "ddp", accumulate)
    _, ours, ckpt = _resume_runs(tmp_path, "zero3", accumulate)
    assert (ckpt / "index.json").exists() and (ckpt / "client_state.pt").exists()
    for a, b in zip(ours, ddp):
        assert a["global_step"] == b["global_step"] == 10
        assert a["lr"] == b["lr"]  # the scheduler came back too
        assert all(
            abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a["losses"], b["losses"], strict=True)
        )


def test_strategy_instance_with_options():
    from zero_strategy.integrations.lightning import register

    cls = register("lightning.pytorch")
    s = cls(stage=2, bucket_size=1000, gradient_clipping=0.0)
    assert s.engine_config.stage == 2 and s.engine_config.bucket_size == 1000


def test_unknown_option_is_refused_with_the_known_ones():
    from zero_strategy import ZeroConfigError
    from zero_strategy.integrations.lightning import register

    with pytest.raises(ZeroConfigError, match=r"Unknown ZeroConfig option\(s\) \['bucket_sise'\]"):
        register("lightning.pytorch")(stage=3, bucket_sise=10)


def test_name_typo_lists_the_registered_names():
    import zero_strategy  # noqa: F401

    with pytest.raises(
        ValueError, match=r"Registered strategy names: .*zero1, zero2, zero3.*Did you mean 'zero3'"
    ):
        L.Trainer(strategy="zro3", accelerator="cpu", devices=1)


def test_mps_is_refused():
    from zero_strategy.integrations.lightning import register

    cls = register("lightning.pytorch")
    strategy = cls(stage=3)
    import torch

    strategy.parallel_devices = [torch.device("mps")]
    with pytest.raises(RuntimeError, match="not on 'mps'"):
        strategy.setup_environment()


def _fit_with_value_clipping(rank, world):
    return fit(rank, world, "zero2", 4, gradient_clip_algorithm="value")


def test_clip_by_value_is_supported_and_matches_ddp():
    ours = run_world(_fit_with_value_clipping, 2)
    ddp = run_world(fit, 2, "ddp", 4, None, None, False, gradient_clip_algorithm="value")
    for a, b in zip(ours, ddp):
        assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a["losses"], b["losses"]))


def test_environment_is_clean():
    assert "LOCAL_RANK" not in os.environ  # ranks run in forked children only
