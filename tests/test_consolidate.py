"""Consolidation (CLI and API), inspection and pretrained loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distributed import run_world
from examples.gpt import GPT
from training import TINY, make_model, make_optimizer, train_zero_resumable
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.checkpoint.consolidate import consolidate
from zero_strategy.checkpoint.safe_load import CheckpointError
from zero_strategy.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank stage-3 checkpoint and the consolidated state the engine itself reports."""
    ckpt = str(tmp_path_factory.mktemp("ck") / "ckpt")
    _, state, _ = run_world(train_zero_resumable, 2, 3, range(3), ckpt, False, True)[0]
    return ckpt, state


def test_safetensors_output_loads_strictly_into_the_model(trained, tmp_path):
    ckpt, state = trained
    assert main(["consolidate", ckpt, str(tmp_path / "out"), "--quiet"]) == 0
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    model = GPT(TINY)
    model.load_state_dict(loaded, strict=True)  # tied names are both present
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_sharded_safetensors_with_hf_index(trained, tmp_path):
    ckpt, state = trained
    files = consolidate(ckpt, tmp_path / "out", max_shard_size="20KB", show_progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    assert set(index["weight_map"]) == set(state)
    assert len(files) == len(shards) + 1
    merged = {}
    for shard in shards:
        merged.update(load_file(tmp_path / "out" / shard))
    assert all(torch.equal(merged[k], v) for k, v in state.items())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype_cast(trained, tmp_path, dtype):
    ckpt, state = trained
    consolidate(ckpt, tmp_path / "out", dtype=dtype, show_progress=False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        t = f.get_tensor("blocks.0.fc.weight")
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert t.dtype == want and torch.equal(t, state["blocks.0.fc.weight"].to(want))


def test_torch_format_loads_with_weights_only(trained, tmp_path):
    ckpt, state = trained
    out = tmp_path / "model.pt"
    assert main(["consolidate", ckpt, str(out), "--format", "torch", "--quiet"]) == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    import zipfile

    assert zipfile.ZipFile(out).testzip() is None  # CRCs patched: a valid zip archive


def test_lightning_format_carries_state_dict_and_trainer_fields(trained, tmp_path):
    ckpt, state = trained
    out = tmp_path / "model.ckpt"
    consolidate(ckpt, out, fmt="lightning", show_progress=False)
    loaded = torch.load(out, weights_only=True)
    assert loaded["global_step"] == 3 and "pytorch-lightning_version" in loaded
    # client state saved alongside (a tensor included) survives.
    assert loaded["next_step"] == 3 and torch.equal(loaded["tag"], torch.tensor([7]))
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in state.items())


def _frozen_checkpoint(rank, world, path):
    model = make_model()
    model.blocks[0].requires_grad_(False)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    engine.save_checkpoint(path)


def test_exclude_frozen(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_world(_frozen_checkpoint, 2, ckpt)
    consolidate(ckpt, tmp_path / "out", exclude_frozen=True, show_progress=False)
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert not any(n.startswith("blocks.0.") for n in names)
    assert "blocks.1.fc.weight" in names


def test_inspect_summarizes(trained, capsys):
    ckpt, _ = trained
    assert main(["inspect", ckpt]) == 0
    out = capsys.readouterr().out
    assert "world size   2   stage 3   step 3" in out
    n = sum(p.numel() for p in {id(p): p for p in make_model().parameters()}.values())
    assert f"parameters   {n:,}" in out
    assert "exp_avg" in out and "complete     yes" in out


def test_cli_errors_name_the_problem(tmp_path, trained):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_strategy.cli",
            "consolidate",
            str(tmp_path),
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "has no index.json" in proc.stderr
    ckpt, _ = trained
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(ckpt, broken)
    f = broken / "rank00001.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="unreadable"):
        from zero_strategy.checkpoint.inspect import summary

        summary(broken)


# ------------------------------------------------------------------ pretrained weights
def _load_pretrained(rank, world, path, stage, **extra):
    with torch.device("meta"):
        model = GPT(TINY)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **extra))
    stats = engine.load_pretrained(path)
    return stats["elements_read"], engine.full_state_dict()


@pytest.mark.parametrize(("sharded", "offload"), [(False, False), (True, False), (False, True)])
def test_pretrained_safetensors_load_into_stage3_reading_only_own_ranges(
    tmp_path, sharded, offload
):
    """Also with the shards on disk (offload_params): written there unit by unit."""
    source = make_model(seed=5)
    state = {
        k: v for k, v in source.state_dict().items() if k != "lm_head.weight"
    }  # HF-style, tied once
    if sharded:
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(state, tmp_path, max_shard_size="30KB")
        path = str(tmp_path)
        assert (tmp_path / "model.safetensors.index.json").exists()
    else:
        save_file(state, tmp_path / "w.safetensors")
        path = str(tmp_path / "w.safetensors")
    extra = {}
    if offload:
        (tmp_path / "offload").mkdir()
        extra = {"offload_params": "disk", "offload_dir": str(tmp_path / "offload")}
    results = run_world(_load_pretrained, 2, path, 3, **extra)
    total = sum(v.numel() for v in state.values())
    for read, _ in results:  # its own half (padding aside), never the model
        assert read <= total // 2 + 1, (read, total)
    assert sum(read for read, _ in results) == total
    loaded = results[0][1]
    for name, value in source.state_dict().items():
        assert torch.equal(loaded[name], value), name


def test_pretrained_mismatch_lists_names(tmp_path):
    save_file({"wte.weight": torch.zeros(3, 3)}, tmp_path / "w.safetensors")
    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    with pytest.raises(
        ValueError,
        match=r"missing \[.*shape-mismatched \['wte.weight: file \(3, 3\).*Build the model with the",
    ):
        engine.load_pretrained(tmp_path / "w.safetensors")


def _lit_checkpoint(rank, world, path):
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self, n_layer: int = 2):
            super().__init__()
            self.save_hyperparameters()
            self.model = GPT(TINY)

    lit = LitGPT(n_layer=2)
    engine = ZeroEngine(lit, torch.optim.AdamW(lit.parameters()), ZeroConfig(stage=3))
    engine.save_checkpoint(path, client_state={"hyper_parameters": dict(lit.hparams), "epoch": 1})
    return engine.full_state_dict()


def test_lightning_format_loads_with_load_from_checkpoint(tmp_path):
    L = pytest.importorskip("lightning")
    ckpt = str(tmp_path / "ckpt")
    state = run_world(_lit_checkpoint, 2, ckpt)[0]
    out = tmp_path / "model.ckpt"
    assert main(["consolidate", ckpt, str(out), "--format", "lightning", "--quiet"]) == 0

    class LitGPT(L.LightningModule):
        def __init__(self, n_layer: int = 2):
            super().__init__()
            self.save_hyperparameters()
            self.model = GPT(TINY)

    restored = LitGPT.load_from_checkpoint(out)
    assert restored.hparams.n_layer == 2
    for name, value in restored.state_dict().items():
        assert torch.equal(value, state[name]), name


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/zero_strategy_pwned_ckpt",))


def test_a_pickle_planted_in_a_consolidated_ckpt_is_refused_and_never_run(trained, tmp_path):
    """The consolidated `.ckpt` is a torch file: whoever reads it back through this
    project (Fabric's load of a full state dict, the Lightning wrapper's client state)
    gets a CheckpointError naming it, and Lightning's own load_from_checkpoint refuses it
    as well; the planted code never runs."""
    import pickle
    from pathlib import Path

    from zero_strategy.integrations.fabric import read_state_dict

    ckpt, _ = trained
    out = tmp_path / "model.ckpt"
    assert main(["consolidate", ckpt, str(out), "--format", "lightning", "--quiet"]) == 0
    assert read_state_dict(out)  # the real one loads
    marker = Path("/tmp/zero_strategy_pwned_ckpt")
    marker.unlink(missing_ok=True)
    out.write_bytes(pickle.dumps({"state_dict": _Exploit()}))
    with pytest.raises(CheckpointError, match=r"model\.ckpt holds objects that safe loading"):
        read_state_dict(out)
    L = pytest.importorskip("lightning")
    with pytest.raises(pickle.UnpicklingError):
        L.LightningModule.load_from_checkpoint(out)
    assert not marker.exists()


def test_with_optimizer_writes_the_optimizer_state_whole_by_name(trained, tmp_path):
    """`consolidate --format lightning --with-optimizer`: what state_dict_type="full"
    writes, from a sharded checkpoint after the fact. Each trained parameter's Adam state
    is whole, in its parameter's shape, under its name; any other format refuses it."""
    ckpt, state = trained
    out = tmp_path / "full.ckpt"
    args = ["consolidate", ckpt, str(out), "--format", "lightning", "--with-optimizer", "--quiet"]
    assert main(args) == 0
    saved = torch.load(out, weights_only=True)
    (optimizer,) = saved["optimizer_states"]
    names = [n for group in optimizer["param_groups"] for n in group["params"]]
    assert names and set(names) <= set(state) and len(set(names)) == len(names)
    for name in names:
        moments = optimizer["state"][name]
        assert moments["exp_avg"].shape == moments["exp_avg_sq"].shape == state[name].shape
        assert moments["exp_avg_sq"].abs().sum() > 0  # trained: real state, not zeros
    with pytest.raises(ValueError, match="fmt='lightning'"):
        consolidate(ckpt, tmp_path / "x.pt", fmt="torch", with_optimizer=True)
