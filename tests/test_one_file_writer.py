"""The one-file checkpoint written in parallel: every rank writes its own ranges of one
torch file, and the file is the one consolidation makes from the sharded checkpoint of
the same state (byte for byte in every tensor), with valid CRCs, no sharded copy beside
it, and each rank writing about its share."""

from __future__ import annotations

import os
import random
import zipfile
import zlib

import pytest
import torch

from tests.distributed import run_world
from training import local_batch, make_model, make_optimizer
from zero_strategy.checkpoint.torch_archive import Record, crc32_combine, record_crc


def test_crc32_combine_is_the_crc_of_the_joined_bytes():
    rng = random.Random(0)
    for _ in range(50):
        a = rng.randbytes(rng.randrange(0, 300))
        b = rng.randbytes(rng.randrange(0, 300))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_record_not_covered_exactly_once_is_refused():
    data = bytes(range(100))
    parts = [(0, 40, zlib.crc32(data[:40])), (40, 60, zlib.crc32(data[40:]))]
    assert record_crc(parts, Record("r", 0, 100)) == zlib.crc32(data)
    with pytest.raises(RuntimeError, match=r"bytes \[40, 50\) of 100 were written by no rank"):
        record_crc([parts[0], (50, 50, 0)], Record("r", 0, 100))
    with pytest.raises(RuntimeError, match="40 of its 100 bytes"):
        record_crc(parts[:1], Record("r", 0, 100))


def _model(moe: bool):
    if not moe:
        return make_model()
    from test_moe import moe_model

    return moe_model(2)


def _trained_engine(rank, world, stage, moe, extra):
    """Two steps of the small GPT (or an MoE one, its experts over 2 ranks)."""
    from zero_strategy import ZeroConfig, ZeroEngine

    model = _model(moe)
    if extra.get("offload_dir"):
        extra = {**extra, "offload_dir": f"{extra['offload_dir']}/{rank}"}
        os.makedirs(extra["offload_dir"], exist_ok=True)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **extra))
    for step in range(2):
        loss = engine(*local_batch(step, 0, rank, world, model.cfg))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return engine


def _tensor_parallel_engine():
    """A Llama under tensor parallelism over 2 ranks, at stage 3, one step."""
    from tensor_parallel_models import batches
    from test_tensor_parallel import _engine, _train

    engine, index = _engine(1, 2, 3)
    _train(engine, index, 1, batches(1, 4))
    return engine


def _save_both_ways(rank, world, folder, stage, moe, extra):
    import torch.distributed as dist

    from zero_strategy.checkpoint.consolidate import consolidate

    if extra.get("tensor_parallel"):
        engine = _tensor_parallel_engine()
    else:
        engine = _trained_engine(rank, world, stage, moe, extra)
    client = {"epoch": 3, "probe": torch.arange(5.0)}
    engine.save_checkpoint(f"{folder}/sharded", client_state=client)
    before = _bytes_written()
    engine.save_checkpoint(f"{folder}/one.ckpt", client_state=client, one_file=True)
    written = _bytes_written() - before
    engine.close()
    if rank == 0:
        consolidate(f"{folder}/sharded", f"{folder}/ref.ckpt", "lightning", with_optimizer=True)
    dist.barrier()
    return written


def _bytes_written() -> int:
    """What this process has written to storage so far (the kernel's count)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _assert_same(a, b, where="checkpoint"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _same_as_consolidated(folder) -> dict:
    assert sorted(p for p in os.listdir(folder) if p != "offload") == [
        "one.ckpt",
        "ref.ckpt",
        "sharded",
    ]  # no partial file or sharded copy left beside it
    one = torch.load(folder / "one.ckpt", weights_only=True)
    _assert_same(one, torch.load(folder / "ref.ckpt", weights_only=True))
    assert one["epoch"] == 3 and torch.equal(one["probe"], torch.arange(5.0))
    with zipfile.ZipFile(folder / "one.ckpt") as z:
        assert z.testzip() is None  # every record's CRC is its bytes'
    return one


def test_tensor_parallel_blocks_go_through_a_sharded_copy(tmp_path):
    """A column block is not a range of the whole tensor: under tensor parallelism the
    file is streamed from a sharded copy by rank 0 (removed after), the same file."""
    pytest.importorskip("transformers")
    written = run_world(_save_both_ways, 2, str(tmp_path), 3, False, {"tensor_parallel": True})
    one = _same_as_consolidated(tmp_path)
    total = _tensor_bytes(one)
    assert written[0] > total > written[1]  # rank 0 wrote the whole file, besides its copy
    assert "model.layers.0.self_attn.q_proj.weight" in one["state_dict"]


@pytest.mark.parametrize(
    ("stage", "moe", "offload"),
    [(3, False, False), (1, False, False), (3, False, True), (3, True, False)],
    ids=["stage3", "stage1", "stage3-on-disk", "moe-stage3"],
)
def test_the_file_written_in_parallel_is_the_consolidated_one(tmp_path, stage, moe, offload):
    """Parameters split across ranks mid-tensor, tied weights, the optimizer state (and
    on disk: read in unit by unit; MoE: each expert-parallel rank's experts under their
    global names) land where consolidation puts them."""
    extra = {}
    if offload:
        extra = {
            "offload_params": "disk",
            "offload_optimizer": "disk",
            "offload_dir": str(tmp_path / "offload"),
        }
    written = run_world(_save_both_ways, 2, str(tmp_path), stage, moe, extra)
    one = _same_as_consolidated(tmp_path)
    total = _tensor_bytes(one)
    assert sum(written) < 1.3 * total  # the data once, beside the archive's headers
    for nbytes in written:  # each rank its share, not the model
        assert 0.3 * total < nbytes < 0.7 * total, (written, total)


def _refused_save(path: str, client_state: dict | None = None):
    """A one-file save at stage 3 that should be refused: its message, and what the
    folder holds afterwards (None, [] when it was not refused)."""
    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.checkpoint.safe_load import CheckpointError

    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    try:
        engine.save_checkpoint(path, client_state=client_state, one_file=True)
    except CheckpointError as e:
        return str(e), sorted(os.listdir(os.path.dirname(path)))
    finally:
        engine.close()
    return None, []


def _full_disk(rank, world, path):
    from zero_strategy.checkpoint import one_file_writer

    one_file_writer.free_bytes = lambda path: 1024
    return _refused_save(path)


def test_a_disk_without_room_for_the_file_is_refused_before_it_is_begun(tmp_path):
    for message, listed in run_world(_full_disk, 2, str(tmp_path / "last.ckpt")):
        assert message is not None and "state_dict_type='sharded'" in message, message
        assert "MiB free" in message and listed == []


def _into_a_new_folder(rank, world, path):
    from zero_strategy import ZeroConfig, ZeroEngine

    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=3))
    engine.save_checkpoint(path, one_file=True)
    engine.close()
    return os.path.isfile(path)


def test_the_files_folder_is_made_when_missing(tmp_path):
    """Lightning's first checkpoint goes into a folder nobody made yet."""
    path = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=8.ckpt"
    assert run_world(_into_a_new_folder, 2, str(path)) == [True, True]
    assert torch.load(path, weights_only=True)["state_dict"]


def _unsafe_client_state(rank, world, path):
    return _refused_save(path, client_state={"sampler": random.Random(0)})


def test_a_client_state_a_safe_load_refuses_is_refused_and_nothing_is_left(tmp_path):
    """The file is serialized once (torch.save counts as under DDP: once, on rank 0) and
    read back whole with weights_only=True before any rank writes into it."""
    for message, listed in run_world(_unsafe_client_state, 2, str(tmp_path / "last.ckpt")):
        assert message is not None and "weights_only=True" in message, message
        assert listed == []
        assert "Keep only tensors, numbers, strings, lists and dicts" in message
        assert listed == []
