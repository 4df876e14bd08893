"""Load pretrained weights from safetensors into a (sharded) engine: each rank reads only
the ranges of each tensor that its shard holds, so the full model is never in memory.

Accepts a `.safetensors` file, a directory holding `model.safetensors`, or a Hugging Face
sharded set (`model.safetensors.index.json` plus its shards).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from .engine import ZeroEngine


def _locate(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if single.exists():
        return _locate(single)
    raise FileNotFoundError(
        f"No safetensors weights at {path}: expected a .safetensors file, a directory with "
        "model.safetensors, or model.safetensors.index.json with its shards."
    )


def _read_range(handle, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the flattened tensor, reading whole rows of dimension 0 only."""
    if not shape:
        return handle.get_tensor(name).reshape(-1)[lo:hi]
    row = math.prod(shape[1:])
    first, last = lo // row, -(-hi // row)
    rows = handle.get_slice(name)[first:last]
    return rows.reshape(-1)[lo - first * row : hi - first * row]


def load_pretrained(
    engine: ZeroEngine, path: str | os.PathLike, strict: bool = True
) -> dict[str, int]:
    """Fill the engine's master shards from safetensors; returns how many elements this
    rank read. With `strict`, names missing from the files or left unused raise."""
    engine.wait_for_parameters()
    located = _locate(Path(path))
    handles: dict[Path, object] = {}
    wanted: set[str] = set()
    missing: list[str] = []
    shape_errors: list[str] = []
    read = 0
    for unit in engine.units:
        for slot in unit.layout.slots:
            source = next((n for n in (slot.name, *slot.aliases) if n in located), None)
            if source is None:
                missing.append(slot.name)
                continue
            wanted.update({slot.name, *slot.aliases} & located.keys())
            file = located[source]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            handle = handles[file]
            stored_shape = tuple(handle.get_slice(source).get_shape())
            if stored_shape != tuple(slot.shape):
                shape_errors.append(f"{source}: file {stored_shape} vs model {tuple(slot.shape)}")
                continue
            lo, hi = max(unit.opt_start, slot.offset), min(unit.opt_end, slot.end)
            if lo < hi:
                values = _read_range(
                    handle, source, stored_shape, lo - slot.offset, hi - slot.offset
                )
                unit.master[lo - unit.opt_start : hi - unit.opt_start].copy_(values)
                read += hi - lo
    unexpected = sorted(set(located) - wanted - {n for n, _ in engine.module.named_buffers()})
    if shape_errors or (strict and (missing or unexpected)):
        raise ValueError(
            f"Pretrained weights at {path} do not match the model: missing {missing[:10]}; "
            f"unexpected {unexpected[:10]}; shape-mismatched {shape_errors[:10]}. "
            + ("Pass strict=False to load the matching tensors only." if not shape_errors else "")
        )
    for name, buf in engine.module.named_buffers():
        if name in located:
            file = located[name]
            handles.setdefault(file, safe_open(str(file), framework="pt"))
            buf.data.copy_(handles[file].get_tensor(name))
    engine.refresh_from_masters()
    return {"elements_read": read}
