"""Lightning's stock `WeightAveraging` (here `EMAWeightAveraging`) saved and resumed under
the ZeRO strategy: its checkpoint puts the averaged weights in "state_dict" and the live
ones in "current_model_state"; a resume through `ckpt_path` continues as the uninterrupted
run, in both checkpoint forms, and the one file reads as DDP's does."""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_world

pytest.importorskip("lightning")

from lightning_helpers import lit_module_class, loader, quiet_trainer

EPOCHS, SAVED_AT = 4, 2


def _strategy(name: str):
    if name == "ddp":
        return "ddp"
    from zero_strategy.integrations.lightning import ZeroStrategy

    stage, _, state_dict_type = name.removeprefix("zero").partition("-")
    return ZeroStrategy(stage=int(stage), state_dict_type=state_dict_type or "sharded")


def _ema(rank, world, strategy, ckpt_dir, resume=None, precision="32-true"):
    """EMA over 4 epochs of 4 steps, a checkpoint after each epoch; from `resume`'s."""
    import lightning as L

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29553")
    cb = L.pytorch.callbacks
    ema = cb.EMAWeightAveraging(decay=0.8, use_buffers=False)
    saves = cb.ModelCheckpoint(
        dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}"
    )
    val_losses: list[float] = []

    class Record(L.pytorch.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):  # of the averaged model
            val_losses.append(float(trainer.callback_metrics["val_loss"]))

    trainer = quiet_trainer(
        world,
        _strategy(strategy),
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[ema, saves, Record()],
        precision=precision,
    )
    module = lit_module_class()()
    trainer.fit(
        module, loader(n_batches=4, world=world), loader(n_batches=2, world=world), ckpt_path=resume
    )
    averaged = {k: v.detach().clone() for k, v in ema._average_model.module.state_dict().items()}
    if trainer.strategy.__class__.__name__ == "ZeroStrategy":
        with trainer.strategy.engine.gathered_parameters():
            final = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        final = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return val_losses, final, averaged


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("strategy", "precision"),
    [
        ("zero3", "32-true"),
        ("zero3-full", "32-true"),
        ("zero1", "32-true"),
        ("ddp", "32-true"),
        # bf16 compute copies over fp32 masters: the live weights handed back are the
        # masters, not the copies (which would round them)
        ("zero3", "bf16-true"),
    ],
)
def test_an_ema_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(
    strategy, precision, tmp_path
):
    through = run_world(_ema, 2, strategy, str(tmp_path / "through"), None, precision)[0]
    saved = str(tmp_path / "through" / f"epoch={SAVED_AT - 1}.ckpt")
    resumed = run_world(_ema, 2, strategy, str(tmp_path / "again"), saved, precision)[0]
    (val, final, averaged), (val_through, final_through, averaged_through) = resumed, through
    torch.testing.assert_close(val, val_through[SAVED_AT:], rtol=1e-5, atol=1e-6)
    _close(final, final_through)  # the live weights (the averaged ones go in at the end)
    _close(averaged, averaged_through)


def test_the_one_file_holds_the_averaged_weights_where_ddp_does(tmp_path):
    """state_dict_type="full": "state_dict" is the averaged model (what
    `load_from_checkpoint` gives), "current_model_state" the live one, as DDP writes them."""
    ours = run_world(_ema, 2, "zero3-full", str(tmp_path / "zero"))[0]
    ddp = run_world(_ema, 2, "ddp", str(tmp_path / "ddp"))[0]
    _close(ours[2], ddp[2])
    name = f"epoch={EPOCHS - 1}.ckpt"
    zero = torch.load(tmp_path / "zero" / name, weights_only=True)
    want = torch.load(tmp_path / "ddp" / name, weights_only=True)
    for key in ("state_dict", "current_model_state"):
        _close(zero[key], want[key])
    _close(zero["averaging_state"], want["averaging_state"])
    model = lit_module_class().load_from_checkpoint(tmp_path / "zero" / name)
    _close(model.state_dict(), want["state_dict"])


def test_a_consolidated_sharded_checkpoint_is_the_one_file_and_resumes(tmp_path):
    """`zero-strategy consolidate --format lightning` of the sharded checkpoint puts the
    model where the callback moved it, as the one-file save does; and a one-file
    checkpoint DDP wrote resumes under zero3 as under DDP."""
    from zero_strategy.checkpoint.consolidate import consolidate

    run_world(_ema, 2, "zero3", str(tmp_path / "sharded"))
    run_world(_ema, 2, "zero3-full", str(tmp_path / "full"))
    name = f"epoch={SAVED_AT - 1}.ckpt"
    out = tmp_path / "consolidated.ckpt"
    consolidate(
        tmp_path / "sharded" / name, out, "lightning", show_progress=False, with_optimizer=True
    )
    got = torch.load(out, weights_only=True)
    want = torch.load(tmp_path / "full" / name, weights_only=True)
    for key in ("state_dict", "current_model_state", "averaging_state"):
        _close(got[key], want[key])

    ddp_dir = tmp_path / "ddp"
    through = run_world(_ema, 2, "ddp", str(ddp_dir))[0]
    resumed = run_world(_ema, 2, "zero3", str(tmp_path / "again"), str(ddp_dir / name))[0]
    torch.testing.assert_close(resumed[0], through[0][SAVED_AT:], rtol=1e-5, atol=1e-6)
    _close(resumed[1], through[1])
    _close(resumed[2], through[2])
