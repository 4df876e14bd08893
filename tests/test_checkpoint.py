"""Sharded checkpoints: resume equals uninterrupted, at any world size and stage."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from disks import mount_small_tmpfs, unmount
from distributed import run_world
from training import make_model, make_optimizer, train_zero_resumable
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.checkpoint import save_agreement
from zero_strategy.checkpoint.consolidate import consolidate
from zero_strategy.checkpoint.safe_load import CheckpointError
from zero_strategy.checkpoint.safetensors_io import SafetensorsFile

TOTAL, CUT = 8, 4


def _relative_close(a: list[float], b: list[float], tol: float) -> bool:
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_at_the_same_world_and_stage_is_bit_for_bit(stage, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full_losses, full_state, _ = run_world(
        train_zero_resumable, 2, stage, range(TOTAL), ckpt, False, False
    )[0]
    run_world(train_zero_resumable, 2, stage, range(CUT), ckpt, False, True)
    # A different seed: everything must come from the checkpoint.
    losses, state, client = run_world(
        train_zero_resumable, 2, stage, range(CUT, TOTAL), ckpt, True, False, seed=1
    )[0]
    assert losses == full_losses[CUT:]
    for name, value in full_state.items():
        assert torch.equal(state[name], value), name
    assert client["next_step"] == CUT and torch.equal(client["tag"], torch.tensor([7]))


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory):
    """Saved by 4 ranks at stage 3 after CUT steps, and the uninterrupted 4-rank run."""
    ckpt = str(tmp_path_factory.mktemp("w4") / "ckpt")
    full = run_world(train_zero_resumable, 4, 3, range(TOTAL), ckpt, False, False)[0]
    run_world(train_zero_resumable, 4, 3, range(CUT), ckpt, False, True)
    return ckpt, full


@pytest.mark.parametrize(("world", "stage"), [(3, 3), (2, 3), (1, 3), (2, 1), (3, 2)])
def test_resume_at_another_world_size_and_stage(world, stage, saved_at_four):
    ckpt, (full_losses, full_state, _) = saved_at_four
    losses, state, _ = run_world(
        train_zero_resumable, world, stage, range(CUT, TOTAL), ckpt, True, False, seed=1
    )[0]
    assert _relative_close(losses, full_losses[CUT:], 1e-5), (losses, full_losses[CUT:])
    num = sum(((state[k] - v) ** 2).sum() for k, v in full_state.items())
    den = sum((v**2).sum() for v in full_state.values())
    assert (num / den).sqrt() < 1e-5


def test_stage_1_checkpoint_resumes_at_stage_3_and_back(tmp_path):
    a = str(tmp_path / "a")
    full_losses, full_state, _ = run_world(
        train_zero_resumable, 2, 1, range(TOTAL), a, False, False
    )[0]
    run_world(train_zero_resumable, 2, 1, range(3), a, False, True)
    run_world(train_zero_resumable, 2, 3, range(3, 6), a, True, True)
    losses, state, _ = run_world(train_zero_resumable, 2, 1, range(6, TOTAL), a, True, False)[0]
    assert _relative_close(losses, full_losses[6:], 1e-5)
    for name, value in full_state.items():
        assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), name


# ------------------------------------------------------------------ the format itself
def _save_single(tmp_path: Path, stage: int = 3, seed: int = 0) -> tuple[str, ZeroEngine]:
    model = make_model(seed)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    x = torch.randint(64, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    path = str(tmp_path / "ckpt")
    engine.save_checkpoint(path)
    return path, engine


def _fresh_engine(stage: int = 3, **model_kwargs) -> ZeroEngine:
    model = make_model(**model_kwargs)
    return ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))


def test_layout_is_safetensors_plus_json(tmp_path):
    path, _ = _save_single(tmp_path)
    files = sorted(os.listdir(path))
    assert files == ["index.json", "rank00000.safetensors"]
    index = json.loads(Path(path, "index.json").read_text())
    # The stage the engine ran: one process keeps everything in place (stage 0) whatever
    # was asked for.
    assert index["world_size"] == 1 and index["stage"] == 0 and index["step"] == 1
    assert index["params"]["wte.weight"]["aliases"] == ["lm_head.weight"]
    assert index["optimizer"]["elementwise_state"] == ["exp_avg", "exp_avg_sq"]
    assert index["optimizer"]["scalar_state"][0]["step"]["value"] == 1.0


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"is not a directory.*Pass the directory that save_checkpoint wrote"
    ):
        _fresh_engine().load_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"has no index\.json"):
        _fresh_engine().load_checkpoint(tmp_path)


def test_missing_rank_file(tmp_path):
    path, _ = _save_single(tmp_path)
    os.remove(Path(path, "rank00000.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"incomplete: missing \['rank00000.safetensors'\].*Restore the checkpoint",
    ):
        _fresh_engine().load_checkpoint(path)


def test_truncated_rank_file(tmp_path):
    path, _ = _save_single(tmp_path)
    f = Path(path, "rank00000.safetensors")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        _fresh_engine().load_checkpoint(path)


def test_index_that_does_not_match_the_files(tmp_path):
    path, _ = _save_single(tmp_path)
    index_path = Path(path, "index.json")
    index = json.loads(index_path.read_text())
    index["params"]["ln_f.weight"]["pieces"][0]["end"] -= 3
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index does not match the files. Restore the"):
        _fresh_engine().load_checkpoint(path)


def test_checkpoint_of_another_model_lists_the_differences(tmp_path):
    from examples.gpt import GPTConfig

    path, _ = _save_single(tmp_path)
    other = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=48)
    with pytest.raises(CheckpointError) as err:
        _fresh_engine(cfg=other).load_checkpoint(path)
    message = str(err.value)
    assert "missing ['blocks.2." in message
    assert "shape-mismatched ['blocks.0.attn.proj.bias: checkpoint (32,) vs model (48,)" in message


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/zero_strategy_pwned",))


def test_malicious_pickle_in_the_directory_is_never_executed(tmp_path):
    path, _ = _save_single(tmp_path)
    Path("/tmp/zero_strategy_pwned").unlink(missing_ok=True)
    with open(Path(path, "client_state.pt"), "wb") as f:
        pickle.dump(_Exploit(), f)
    with pytest.raises(
        CheckpointError, match=r"safe loading \(weights_only=True\) refuses.*not executed"
    ):
        _fresh_engine().load_checkpoint(path)
    assert not Path("/tmp/zero_strategy_pwned").exists()


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    """An I/O error from the writer (safetensors raises its own error type, whose text
    carries the OS error) is a CheckpointError; the previous checkpoint is untouched."""
    from safetensors import SafetensorError

    path, engine = _save_single(tmp_path)
    before = json.loads(Path(path, "index.json").read_text())

    def crash(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: Input/output error (os error 5)")

    monkeypatch.setattr(save_agreement, "save_file", crash)
    x = torch.randint(64, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    with pytest.raises(CheckpointError, match=r"ckpt\.tmp failed \(SaveFailed: .*Input/output"):
        engine.save_checkpoint(path)
    assert json.loads(Path(path, "index.json").read_text()) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the half-written directory is gone
    _fresh_engine().load_checkpoint(path)  # still loads


@pytest.fixture
def small_disk(tmp_path):
    """A 640 KiB file system (a tmpfs, where this process may mount one; else None): one
    checkpoint of the tiny model fits, a second beside it does not."""
    mount = tmp_path / "disk"
    mounted = mount_small_tmpfs(mount, "640k")
    yield mount if mounted else None
    if mounted:
        unmount(mount)


def test_a_full_disk_names_the_directory_and_the_bytes_needed(tmp_path, small_disk, monkeypatch):
    """ENOSPC from the writer, on a real full file system where one can be mounted (the
    free-space check told there is room, so the write itself fails), otherwise
    safetensors' own error for it: the error names the directory and the bytes the rank
    needed; the previous checkpoint is untouched; the next save, with room, succeeds."""
    import shutil

    from safetensors import SafetensorError

    root = small_disk or tmp_path
    path, engine = _save_single(root)
    before = Path(path, "rank00000.safetensors").read_bytes()
    real_save_file = save_agreement.save_file
    if small_disk is None:

        def full(*args, **kwargs):
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(save_agreement, "save_file", full)
    usage = shutil.disk_usage(root)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**12))
    with pytest.raises(CheckpointError) as err:
        engine.save_checkpoint(path)
    message = str(err.value)
    assert f"no space left on the device of {root / 'ckpt.tmp'}" in message
    assert re.search(r"this rank's file needs [\d,]+ bytes", message)
    assert f"the previous checkpoint at {path} is intact" in message
    assert Path(path, "rank00000.safetensors").read_bytes() == before
    assert sorted(os.listdir(root)) == ["ckpt"]
    _fresh_engine().load_checkpoint(path)
    monkeypatch.undo()
    assert save_agreement.save_file is real_save_file
    elsewhere = tmp_path / "elsewhere"
    engine.save_checkpoint(elsewhere)
    _fresh_engine().load_checkpoint(elsewhere)


def test_a_save_larger_than_the_free_space_is_refused_before_writing(
    tmp_path, small_disk, monkeypatch
):
    """The ranks of a host together need more than the file system has free: refused
    before any rank writes (on a real small file system where one can be mounted)."""
    import shutil

    root = small_disk or tmp_path
    path, engine = _save_single(root)
    if small_disk is None:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(
        CheckpointError, match=r"this host's ranks need [\d,]+ bytes and [\d,]+ are free"
    ):
        engine.save_checkpoint(path)
    assert sorted(os.listdir(root)) == ["ckpt"]
    _fresh_engine().load_checkpoint(path)


def test_model_only_load_takes_another_optimizer(tmp_path):
    """Evaluation or fine-tuning from a training checkpoint: the parameters load into an
    engine built with another optimizer, whose state is left alone."""
    path, saved = _save_single(tmp_path)
    expected = saved.full_state_dict()
    model = make_model(seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(model, sgd, ZeroConfig(stage=3))
    with pytest.raises(
        CheckpointError,
        match=r"optimizer is AdamW but the engine's is SGD.*load_optimizer_states=False",
    ):
        engine.load_checkpoint(path)
    engine.load_checkpoint(path, load_optimizer_states=False)
    state = engine.full_state_dict()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    assert not sgd.state and engine.global_steps == 0


def test_fp64_training_resumes_bit_for_bit_and_consolidates_in_fp64(tmp_path):
    """64-true: fp64 masters and optimizer state are stored as fp64, never through fp32."""
    ckpt = str(tmp_path / "fp64")
    full_losses, full_state, _ = run_world(
        train_zero_resumable, 2, 3, range(6), ckpt, False, False, compute_dtype="fp64"
    )[0]
    _, saved, _ = run_world(
        train_zero_resumable, 2, 3, range(3), ckpt, False, True, compute_dtype="fp64"
    )[0]
    losses, state, _ = run_world(
        train_zero_resumable, 2, 3, range(3, 6), ckpt, True, False, compute_dtype="fp64"
    )[0]
    assert losses == full_losses[3:]
    assert all(v.dtype == torch.float64 and torch.equal(state[k], v) for k, v in full_state.items())
    (written,) = consolidate(ckpt, str(tmp_path / "model.safetensors"), show_progress=False)
    consolidated = SafetensorsFile(written)
    assert torch.equal(consolidated.read("wte.weight"), saved["wte.weight"])


@pytest.mark.parametrize(
    "files", [["../../rank00000.safetensors"], ["/etc/passwd"], ["rank00000.safetensors", "x"]]
)
def test_an_index_naming_other_files_is_refused(files, tmp_path):
    path, _ = _save_single(tmp_path)
    index_path = Path(path, "index.json")
    index = json.loads(index_path.read_text())
    index["files"] = files
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"names files .* Refusing it: Restore the checkpoint"
    ):
        _fresh_engine().load_checkpoint(path)


def test_a_rank_file_that_links_out_of_the_directory_is_refused(tmp_path):
    path, _ = _save_single(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shard = Path(path, "rank00000.safetensors")
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(
        CheckpointError, match=r"leads out of the checkpoint directory.*copy the files, not links"
    ):
        _fresh_engine().load_checkpoint(path)


def test_a_flipped_byte_in_a_shard_is_refused_by_its_checksum(tmp_path):
    """The index records a CRC-32 of every chunk of every tensor; a load (and so a
    consolidation) verifies each chunk it reads."""
    from zero_strategy.checkpoint.consolidate import consolidate

    path, _ = _save_single(tmp_path)
    _flip_a_weight_byte(path)
    with pytest.raises(
        CheckpointError, match=r"rank00000.safetensors: tensor .* fails its checksum"
    ):
        _fresh_engine().load_checkpoint(path)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        consolidate(path, tmp_path / "out", show_progress=False)


def test_a_checkpoint_from_before_checksums_still_loads(tmp_path):
    path, _ = _save_single(tmp_path)
    index_path = Path(path, "index.json")
    index = json.loads(index_path.read_text())
    del index["checksums"]
    index_path.write_text(json.dumps(index))
    _fresh_engine().load_checkpoint(path)


def test_a_header_claiming_terabytes_is_refused_without_reading_it(tmp_path):
    import struct

    path, _ = _save_single(tmp_path)
    shard = Path(path, "rank00000.safetensors")
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 5 << 40)  # a 5 TiB header in a file of kilobytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header of 5497558138880 bytes exceeds the file"):
        _fresh_engine().load_checkpoint(path)


def _flip_a_weight_byte(path: str) -> None:
    """Flip one bit inside the last weight's data (what a load and a consolidation read)."""
    shard = Path(path, "rank00000.safetensors")
    handle = SafetensorsFile(shard)
    weights = [k for k in handle.tensors if "/" not in k]
    last = max(weights, key=lambda k: handle.tensors[k]["data_offsets"][1])
    end = handle.base + handle.tensors[last]["data_offsets"][1]
    handle.close()
    data = bytearray(shard.read_bytes())
    data[end - 1] ^= 0x01
    shard.write_bytes(bytes(data))


def _truncate(path: str) -> None:
    shard = Path(path, "rank00000.safetensors")
    shard.write_bytes(shard.read_bytes()[:-100])


def _offsets_past_the_file(path: str) -> None:
    index_path = Path(path, "index.json")
    index = json.loads(index_path.read_text())
    piece = index["params"]["ln_f.bias"]["pieces"][0]
    piece["start"], piece["end"] = piece["start"] + 10**9, piece["end"] + 10**9
    index_path.write_text(json.dumps(index))


def _lags_not_counts(path: str) -> None:
    _set_lags(path, {"ln_f.bias": "three"})


def _lag_past_the_count(path: str) -> None:
    _set_lags(path, {"ln_f.bias": 10**6})  # behind by more steps than were taken


def _set_lags(path: str, lags: dict) -> None:
    index_path = Path(path, "index.json")
    index = json.loads(index_path.read_text())
    lags_per_group = [{} for _ in index["optimizer"]["param_groups"]]
    lags_per_group[index["params"]["ln_f.bias"]["group"]] = lags
    index["optimizer"]["step_lags"] = lags_per_group
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("corrupt", "problem"),
    [
        (_flip_a_weight_byte, "fails its checksum"),
        (_truncate, "truncated"),
        (_offsets_past_the_file, "index does not match the files"),
        (_lags_not_counts, "'step_lags' gives 'ln_f.bias' a lag of 'three'"),
        (_lag_past_the_count, r"a lag of 1000000 in param group \d, whose step count is 1"),
    ],
)
def test_a_refused_checkpoint_leaves_the_model_as_it_was(corrupt, problem, tmp_path):
    """Every rank verifies all it will read before anything is written into the model:
    a corrupt checkpoint is refused with the model, its optimizer state and its buffers
    untouched (here the flipped byte is in the last tensor a load reads)."""
    path, _ = _save_single(tmp_path)
    corrupt(path)
    engine = _fresh_engine(seed=1)
    x = torch.randint(64, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = {
        (i, k): v.clone()
        for i, s in enumerate(engine.optimizer.state.values())
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    with pytest.raises(CheckpointError, match=problem):
        engine.load_checkpoint(path)
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, params[n]), n
    after = {
        (i, k): v
        for i, s in enumerate(engine.optimizer.state.values())
        for k, v in s.items()
        if isinstance(v, torch.Tensor)
    }
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], state[k]) for k in state)


def test_a_client_state_a_safe_load_could_not_read_is_refused_before_writing(tmp_path):
    """Found at save time, on every rank, before anything is written: not at the resume
    that needs it."""
    path, engine = _save_single(tmp_path)
    with pytest.raises(CheckpointError, match=r"the client state holds objects that a safe load"):
        engine.save_checkpoint(path, client_state={"sampler": _Exploit()})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _fresh_engine().load_checkpoint(path) is None
