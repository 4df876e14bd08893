"""A fit on spawned processes: the main process gets rank 0's trained weights back in a
plain module (Lightning's spawn launcher) and holds no engine. `trainer.save_checkpoint`
there writes one file as DDP does (it raised AttributeError on the missing engine), which
`load_from_checkpoint` and a later run on spawned ranks read."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")


def _trainer(**kwargs):
    import lightning.pytorch as pl

    from zero_strategy.integrations.lightning import ZeroStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=3, start_method="spawn"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_the_main_process_saves_after_a_spawned_fit_as_ddp_does(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    torch.manual_seed(0)
    model = BoringModel()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(max_steps=3)
    trainer.fit(model)
    trained = model.state_dict()
    assert not torch.equal(trained["layer.weight"], initial["layer.weight"])

    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)  # the main process: no engine here
    saved = torch.load(path, weights_only=True)
    # As under DDP: the main process has the weights, not the loops' or optimizer's state.
    assert saved["optimizer_states"] == [] and saved["global_step"] == 0
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in trained.items())
    assert all(
        torch.equal(BoringModel.load_from_checkpoint(path).state_dict()[k], v)
        for k, v in trained.items()
    )

    # Spawned ranks, each with an engine, read the file (the model alone) to validate.
    _trainer().validate(BoringModel(), ckpt_path=path, verbose=False)
