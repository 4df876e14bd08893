"""Consolidate a sharded checkpoint into one model file, one tensor at a time.

Peak memory is the largest tensor (read as fp32, plus its cast) and a small buffer, never
the model: each output file's layout is written first from shapes alone, then every
tensor is read from the rank files, converted and written into its place.

- safetensors: `model.safetensors`, or Hugging Face shards `model-0000i-of-0000n.safetensors`
  plus `model.safetensors.index.json` past `max_shard_size` (split by huggingface_hub).
  The safetensors library writes only from tensors in memory, so the (public, tiny)
  header is written here and tensor bytes are streamed after it.
- torch / lightning: a `torch.save` file whose skeleton is written by torch itself from
  fake tensors (`torch.serialization.skip_data`), its data records then filled in place;
  the lightning form adds the trainer's saved state so `load_from_checkpoint` accepts it.

Tied weights are written under every name (their bytes repeated), so the output loads
with `model.load_state_dict(..., strict=True)`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..layout.partition import FROZEN_GROUP
from ..optim.ema import EMA_KEY
from ..optim.step_lag import COUNT
from ..private_api import fake_tensor_mode
from .one_file import ENGINE_KEY, MODEL_AT
from .read import CheckpointReader
from .state_keys import keys_of_group
from .step_lags_index import checked_step_lags
from .torch_archive import (
    Record,
    patch_crcs,
    tensor_bytes,
    tensors_in_pickle_order,
    write_at,
    write_skeleton,
)

OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


@dataclass(frozen=True)
class Entry:
    name: str  # the name written (a tied weight appears once per alias)
    source: str  # the parameter it is read from
    shape: tuple[int, ...]
    dtype: torch.dtype
    state: str = ""  # "ema/": the parameter's EMA (optimizer state) instead of its value
    optimizer_key: str = ""  # optimizer state ("exp_avg") written as such, not a weight

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _master_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The dtype of a parameter's master and optimizer state: fp64 for fp64 training,
    fp32 otherwise."""
    return torch.float64 if meta["dtype"] == "float64" else torch.float32


def plan(
    reader: CheckpointReader,
    dtype: str | None,
    exclude_frozen: bool,
    weights: str = "model",
    masters: bool = False,
) -> list[Entry]:
    """What the consolidated model holds, in checkpoint order: its weights, or (`weights`
    "ema") their sharded EMA, frozen parameters as they are. `masters`: in the precision
    of the fp32 (fp64) masters rather than the model's, so that a resume from the file
    steps the same values (a bf16 model's weights are not rounded)."""
    if weights not in ("model", "ema"):
        raise ValueError(f"Unknown weights {weights!r}; use 'model' or 'ema'.")
    if weights == "ema" and EMA_KEY not in reader.index["optimizer"]["elementwise_state"]:
        raise ValueError(
            f"{reader.path} holds no EMA of the weights: train with ZeroConfig(ema_decay=...)"
            " (or call engine.update_ema()) before saving, or consolidate weights='model'."
        )
    out: list[Entry] = []
    for name, meta in reader.index["params"].items():
        if exclude_frozen and meta["group"] == FROZEN_GROUP:
            continue
        target = OUT_DTYPES[dtype] if dtype else getattr(torch, meta["dtype"])
        if masters and not dtype:
            target = _master_dtype(meta)
        state = f"{EMA_KEY}/" if weights == "ema" and meta["group"] != FROZEN_GROUP else ""
        for alias in [name, *meta["aliases"]]:
            out.append(Entry(alias, name, tuple(meta["shape"]), target, state))
    for name in reader.index["buffers"]:
        out.append(Entry(name, "buffer/" + name, (), torch.float32))  # resolved when read
    return out


def plan_optimizer(reader: CheckpointReader, groups: range | None = None) -> list[Entry]:
    """Every parameter's elementwise optimizer state (masters' dtype), group by group in
    the optimizer's order (a parameter that two optimizers step: each one's state); of
    the param groups `groups` alone when given."""
    params = reader.index["params"]
    keys = reader.index["optimizer"]["elementwise_state"]
    out: list[Entry] = []
    for g, names in enumerate(_group_names(reader.index)):
        if groups is not None and g not in groups:
            continue
        for name in names:
            meta = params[name]
            dtype = _master_dtype(meta)
            for stored, key in keys_of_group(keys, g, meta["group"]):
                if key != EMA_KEY and reader.holds(name, f"{stored}/"):
                    shape = tuple(meta["shape"])
                    out.append(Entry(f"{stored}/{name}", name, shape, dtype, f"{stored}/", stored))
    return out


def _group_names(index: dict[str, Any]) -> list[list[str]]:
    """Each param group's parameter names in the optimizer's order (the index's order by
    group for checkpoints that did not record it)."""
    opt = index["optimizer"]
    if "param_names" in opt:
        return opt["param_names"]
    groups = range(len(opt["param_groups"]))
    return [[n for n, m in index["params"].items() if m["group"] == g] for g in groups]


def optimizer_states(index: dict[str, Any], elementwise: dict[str, dict[str, Any]]) -> list[dict]:
    """torch's `optimizer.state_dict()` of each of the checkpoint's optimizers, keyed by
    parameter name as FSDP's full optimizer state is (`param_groups[i]["params"]` lists
    the names in the optimizer's order, so a plain optimizer loads it by position too).
    `elementwise[name]` is a parameter's state tensors by stored key (a later
    optimizer's of a parameter that an earlier one steps too, marked); the scalar state
    (Adam's step) is its group's, less the steps the parameter missed (`step_lags`): a
    parameter that never took one has no entry, as in torch."""
    opt = index["optimizer"]
    lags = checked_step_lags(opt)
    names = _group_names(index)
    counts = opt.get("groups_per_optimizer") or [len(opt["param_groups"])]
    out, first = [], 0
    for count in counts:
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for g in range(first, first + count):
            saved = opt["param_groups"][g]
            hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
            groups.append({**hyper, "params": list(names[g])})
            for name in names[g]:
                first_group = index["params"][name]["group"]
                stored_keys = list(elementwise.get(name, ()))
                own = {
                    key: elementwise[name][stored]
                    for stored, key in keys_of_group(stored_keys, g, first_group)
                }
                scalars = _scalars(opt["scalar_state"][g], lags[g].get(name, 0))
                if own and scalars is not None:  # a tensor each: Adam steps it in place
                    state[name] = {**own, **scalars}
        out.append({"state": state, "param_groups": groups})
        first += count
    return out


def _scalars(saved: dict[str, Any], lag: int) -> dict[str, Any] | None:
    """A parameter's scalar state: its group's, its step count less its `lag`; None for
    one that has taken no step."""
    out = {}
    for key, spec in saved.items():
        value = spec["value"] - lag if key == COUNT else spec["value"]
        if key == COUNT and lag and value <= 0:
            return None
        out[key] = (
            torch.tensor(value, dtype=getattr(torch, spec["dtype"])) if spec["dtype"] else value
        )
    return out


def _values(
    reader: CheckpointReader, entry: Entry, scratch: _Scratch | None = None
) -> torch.Tensor:
    """The tensor's consolidated values; read into `scratch` when given (valid until the
    next call), so that streaming allocates nothing per tensor."""
    if entry.source.startswith("buffer/"):
        return reader.buffer(entry.source.removeprefix("buffer/"))
    meta = reader.index["params"][entry.source]
    numel = 1
    for s in meta["shape"]:
        numel *= s
    if entry.dtype == torch.float64:  # fp64 training's masters: never through fp32
        values = reader.read(entry.source, 0, numel, entry.state, dtype=torch.float64)
        return values.view(entry.shape)
    out = scratch.take(numel) if scratch is not None else None
    values = reader.read(entry.source, 0, numel, entry.state, out=out)
    return values.view(entry.shape).to(entry.dtype)


class _Scratch:
    """One fp32 buffer, grown to the largest tensor, reused for every read: a fresh
    allocation per tensor leaves the peak at the allocator's mercy (glibc keeps freed
    multi-megabyte chunks, and the peak varied by ~100 MB between identical runs)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def take(self, numel: int) -> torch.Tensor:
        if self.buf.numel() < numel:
            self.buf = torch.empty(0, dtype=torch.float32)  # free before growing
            self.buf = torch.empty(numel, dtype=torch.float32)
        return self.buf[:numel]


def resolve_buffers(reader: CheckpointReader, entries: list[Entry]) -> list[Entry]:
    """Buffers keep their own dtype and shape, read from rank 0's file header."""
    resolved = []
    for e in entries:
        if e.source.startswith("buffer/"):
            t = reader.buffer(e.source.removeprefix("buffer/"))
            e = Entry(e.name, e.source, tuple(t.shape), t.dtype)
        resolved.append(e)
    return resolved


# ============================================================================ safetensors
def _st_header(entries: list[Entry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in _ST_DTYPES and e.dtype != torch.int64:
            raise ValueError(f"{e.name}: dtype {e.dtype} cannot be written to safetensors here.")
        header[e.name] = {
            "dtype": _ST_DTYPES.get(e.dtype, "I64"),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(reader: CheckpointReader, entries: list[Entry], path: Path, progress) -> None:
    header = _st_header(entries)
    scratch = _Scratch()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for e in entries:
            f.write(tensor_bytes(_values(reader, e, scratch)))
            progress.update(1)


def _shards(entries: list[Entry], max_shard_size: str | int) -> dict[str, list[Entry]]:
    from huggingface_hub import split_torch_state_dict_into_shards

    fake = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    split = split_torch_state_dict_into_shards(fake, max_shard_size=max_shard_size)
    by_name = {e.name: e for e in entries}
    return {
        fname: [by_name[n] for n in names] for fname, names in split.filename_to_tensors.items()
    }


# ============================================================================ torch.save
def entry_skeleton(
    entries: list[Entry], wrap, path: Path
) -> list[tuple[Record, Entry | None, torch.Tensor]]:
    """torch.save(wrap(tensors by entry)) with every storage's bytes left as a hole, from
    fake tensors: each record with the entry whose bytes go there, or None and the real
    tensor of the rest of the object (the client state's, Adam's step counts)."""
    with fake_tensor_mode():
        fake = {e: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    entry_of = {id(tensor): e for e, tensor in fake.items()}
    obj = wrap(fake)
    records = write_skeleton(obj, path)
    return [(r, entry_of.get(id(t)), t) for r, t in zip(records, tensors_in_pickle_order(obj))]


def write_torch(reader: CheckpointReader, entries: list[Entry], path: Path, wrap, progress) -> None:
    """torch.save(wrap(tensors by entry)) without holding the tensors: the archive is
    written from fake tensors, then each data record is filled with the real bytes."""
    scratch = _Scratch()
    crcs: dict[str, int] = {}
    skeleton = entry_skeleton(entries, wrap, path)
    with open(path, "r+b") as f:
        for record, entry, tensor in skeleton:
            data = tensor_bytes(_values(reader, entry, scratch) if entry else tensor)
            if record.size != len(data):
                raise RuntimeError(f"{record.name} has {record.size} bytes, not {len(data)}")
            write_at(f.fileno(), data, record.offset)
            crcs[record.name] = zlib.crc32(data)
            if entry:
                progress.update(1)
    patch_crcs(path, crcs)


def _state_dict(fake: dict[Entry, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {e.name: t for e, t in fake.items() if not e.optimizer_key}


def lightning_wrapper(reader: CheckpointReader, with_optimizer: bool, keys: dict[str, Any] | None):
    """A Lightning checkpoint: the state dict, the trainer's saved state (the client
    state), and with the optimizer its `optimizer_states`; the model under "state_dict",
    or where the client state's `MODEL_AT` says a callback moved it. `keys` ({"model":
    name, "optimizers": [names]}): Fabric's layout instead, each under the name the user
    saved it by, and no Lightning entries added."""
    extra = reader.client_state() or {}
    model_key = keys["model"] if keys else extra.get(MODEL_AT, "state_dict")
    extra = {k: v for k, v in extra.items() if k not in (model_key, "optimizer_states")}
    if keys is None:
        extra.setdefault("epoch", 0)
        extra.setdefault("global_step", reader.index["step"])
        try:  # the installed Lightning's version, read without importing Lightning
            version = importlib.metadata.version("lightning")
        except importlib.metadata.PackageNotFoundError:
            version = "2.0.0"
        extra.setdefault("pytorch-lightning_version", version)

    def wrap(fake: dict[Entry, torch.Tensor]) -> dict[str, Any]:
        out = {model_key: _state_dict(fake), **extra}
        if not with_optimizer:
            return out
        elementwise: dict[str, dict[str, torch.Tensor]] = {}
        for e, t in fake.items():
            if e.optimizer_key:
                elementwise.setdefault(e.source, {})[e.optimizer_key] = t
        states = optimizer_states(reader.index, elementwise)
        if keys is None:
            out["optimizer_states"] = states
        else:
            out.update((k, s) for k, s in zip(keys["optimizers"], states) if k is not None)
        index = reader.index
        out[ENGINE_KEY] = {  # what a resume reads beside the framework's keys
            "step": index["step"],
            "loss_scaler": index["loss_scaler"],
            "optimizer_class": index["optimizer"]["class"],
            "model_key": model_key,
            "optimizer_keys": keys["optimizers"] if keys else None,
        }
        return out

    return wrap


# ============================================================================ entry point
def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str = "safetensors",
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    exclude_frozen: bool = False,
    show_progress: bool = True,
    weights: str = "model",
    with_optimizer: bool = False,
    keys: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the consolidated model (`weights="ema"`: its EMA); returns the files
    written. `with_optimizer` (the lightning format): the optimizer state too, whole, as
    a Lightning checkpoint holds it (`optimizer_states`), and the weights in the masters'
    precision (unless `dtype` says otherwise)."""
    if fmt not in ("safetensors", "torch", "lightning"):
        raise ValueError(f"Unknown format {fmt!r}; use 'safetensors', 'torch' or 'lightning'.")
    if dtype is not None and dtype not in OUT_DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(OUT_DTYPES)}.")
    if with_optimizer and fmt != "lightning":
        raise ValueError("with_optimizer writes a Lightning checkpoint: use fmt='lightning'.")
    reader = CheckpointReader(checkpoint)
    chosen = plan(reader, dtype, exclude_frozen, weights, masters=with_optimizer)
    entries = resolve_buffers(reader, chosen)
    if with_optimizer:
        entries += plan_optimizer(reader)
    progress = _progress(len(entries), show_progress)
    out = Path(out)
    written: list[Path] = []
    try:
        if fmt == "safetensors":
            out.mkdir(parents=True, exist_ok=True)
            shards = _shards(entries, max_shard_size)
            if len(shards) == 1:
                target = out / "model.safetensors"
                write_safetensors(reader, entries, target, progress)
                written.append(target)
            else:
                weight_map = {}
                for fname, part in shards.items():
                    write_safetensors(reader, part, out / fname, progress)
                    written.append(out / fname)
                    weight_map.update({e.name: fname for e in part})
                index = {
                    "metadata": {"total_size": sum(e.nbytes for e in entries)},
                    "weight_map": weight_map,
                }
                (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
                written.append(out / "model.safetensors.index.json")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            wrap = (
                lightning_wrapper(reader, with_optimizer, keys)
                if fmt == "lightning"
                else _state_dict
            )
            write_torch(reader, entries, out, wrap, progress)
            written.append(out)
    finally:
        progress.close()
    return written


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="consolidating", unit="tensor", disable=not enabled)


def iter_tensors(
    checkpoint: str | os.PathLike, dtype: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The consolidated model as (name, tensor) pairs, one tensor in memory at a time."""
    reader = CheckpointReader(checkpoint)
    for e in resolve_buffers(reader, plan(reader, dtype, exclude_frozen=False)):
        yield e.name, _values(reader, e)
