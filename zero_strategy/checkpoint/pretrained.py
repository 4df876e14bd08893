"""Load pretrained weights from safetensors into a (sharded) engine: each rank reads only
the ranges of each tensor that its shard holds (plain reads, no mmap), so the full model
is never in memory.

Accepts a `.safetensors` file, a directory holding `model.safetensors`, or a Hugging Face
sharded set (`model.safetensors.index.json` plus its shards).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..layout.partition import Stored
from ..tensor_parallel import TensorPlacement, read_block
from ..units.flat_unit import FlatUnit, OneResident
from .safetensors_io import SafetensorsFile


def _locate(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    if path.is_file():
        return dict.fromkeys(SafetensorsFile(path).keys(), path)
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


def pretrained_files(name_or_path: str | os.PathLike) -> Path:
    """A local file or directory as it is; otherwise a Hugging Face Hub model name, of
    which the config and safetensors files are downloaded (never pickled weights)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"])
        )
    except Exception as e:
        raise FileNotFoundError(
            f"{name_or_path} is neither a local path nor a Hub model that could be fetched "
            f"({type(e).__name__}: {e}). Pass a directory holding config.json and safetensors "
            "weights."
        ) from e


def load_pretrained(
    units: list[FlatUnit],
    module: nn.Module,
    path: str | os.PathLike,
    strict: bool = True,
    stored: Callable[[FlatUnit, str, tuple[int, ...]], Stored] | None = None,
    into: str | None = None,
    model_names: set[str] = frozenset(),
) -> dict[str, int]:
    """Fill the units' fp32 master shards (and the module's buffers) from safetensors;
    returns how many elements this rank read from the files (exactly its own ranges). With
    `strict`, names missing from the files or left unused raise. The caller refreshes its
    compute copies after. `stored` says where a parameter sits in the files (by default
    under its own name and shape: experts pass their global names or batched rows).

    `into` names the submodule the files are the weights of (a LightningModule's
    `model`): the files' names are relative to it, and the rest of the module is left
    alone. By default: the module itself, or if it is not a Transformers model, the
    outermost one inside it (a LightningModule's, a PEFT model's base). Inside a PEFT
    model, a wrapped layer's `base_layer` reads the base's own name, and its adapter
    weights are not expected in the files. `model_names`: every stored name of the whole
    model, other expert-parallel ranks' experts too, which the files hold and this rank
    leaves (not unexpected)."""
    stored = stored or (lambda unit, name, shape: Stored(name, tuple(shape)))
    files = _Files(_locate(pretrained_files(path)))
    into = _weights_owner(module, files.keys()) if into is None else into
    target = module.get_submodule(into) if into else module
    prefix = f"{into}." if into else ""
    adapters = _adapter_owners(target)
    tensors = _by_model_names(target, files)
    available = set(tensors.keys())
    wanted: set[str] = set()
    missing: list[str] = []
    shape_errors: list[str] = []
    read = 0
    with OneResident(modified=True) as in_memory:  # offloaded shards: unit by unit
        for unit in units:
            for slot in unit.layout.slots:
                places = [
                    _relative(stored(unit, n, slot.shape), prefix)
                    for n in (slot.name, *slot.aliases)
                    if n.startswith(prefix)
                ]
                places = [p for p in places if not _in_adapter(p.name, adapters)]
                if not places:
                    continue  # outside `into`, or a PEFT adapter's own weight
                place = next((p for p in places if p.name in available), None)
                if place is None:
                    missing.append(places[0].name)
                    continue
                source = place.name
                wanted.update({p.name for p in places} & available)
                if tensors.shape(source) != tuple(place.shape):
                    shape_errors.append(
                        f"{source}: file {tensors.shape(source)} vs model {tuple(place.shape)}"
                    )
                    continue
                lo, hi = unit.mine_of(slot)
                if lo < hi and slot.tensor_sharded:  # this position's block of the tensor
                    values, spanned = _tensor_block_range(
                        tensors, source, slot.tensor, lo - slot.offset, hi - slot.offset
                    )
                    in_memory(unit).master[lo - unit.opt_start : hi - unit.opt_start].copy_(values)
                    read += spanned
                elif lo < hi:
                    at = place.offset - slot.offset
                    values = tensors.read_range(source, at + lo, at + hi)
                    in_memory(unit).master[lo - unit.opt_start : hi - unit.opt_start].copy_(values)
                    read += hi - lo
    buffers = dict(target.named_buffers())
    elsewhere = {_relative(Stored(n, ()), prefix).name for n in model_names if n.startswith(prefix)}
    unexpected = sorted(available - wanted - elsewhere - set(buffers))
    missing = [name for name in missing if not _never_saved(target, name)]
    _refuse_a_mismatch(path, missing, unexpected, shape_errors, strict)
    for name, buf in buffers.items():
        if name in available:
            buf.data.copy_(tensors.read(name))
    files.close()
    return {"elements_read": read}


def _refuse_a_mismatch(
    path: str | os.PathLike,
    missing: list[str],
    unexpected: list[str],
    shape_errors: list[str],
    strict: bool,
) -> None:
    """Shapes that differ are always refused; names missing or left over, with `strict`."""
    if shape_errors or (strict and (missing or unexpected)):
        raise ValueError(
            f"Pretrained weights at {path} do not match the model: missing {missing[:10]}; "
            f"unexpected {unexpected[:10]}; shape-mismatched {shape_errors[:10]}. "
            + (
                "Pass strict=False to load the matching tensors only."
                if not shape_errors
                else "Build the model with the configuration these weights were saved from."
            )
        )


def _weights_owner(module: nn.Module, keys: list[str]) -> str:
    """The module itself if the files name its parameters or it holds no Transformers
    model, else the path of the outermost Transformers model inside it."""
    own = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    if own & set(keys):
        return ""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return ""
    for path, candidate in module.named_modules():
        # (by class: a PEFT model forwards unknown attributes to the model it wraps)
        if isinstance(candidate, PreTrainedModel):
            return path
    return ""


BASE_LAYER = "base_layer"  # where PEFT's wrapped layers keep the base model's module


def _relative(place: Stored, prefix: str) -> Stored:
    """A parameter's place in the files, by its name relative to the loaded submodule,
    and by the base model's name inside a PEFT-wrapped layer."""
    name = place.name[len(prefix) :].replace(f".{BASE_LAYER}.", ".")
    return Stored(name, place.shape, place.offset)


def _adapter_owners(module: nn.Module) -> list[str]:
    """The modules of PEFT-wrapped layers (those holding a `base_layer`), whose other
    parameters are the adapter's, as names after `_relative`."""
    return [path for path, m in module.named_modules() if path and hasattr(m, BASE_LAYER)]


def _in_adapter(name: str, owners: list[str]) -> bool:
    base = ("weight", "bias")
    return any(
        name.startswith(f"{owner}.") and name.removeprefix(f"{owner}.") not in base
        for owner in owners
    )


def _tensor_block_range(
    tensors, name: str, placement: TensorPlacement, lo: int, hi: int
) -> tuple[torch.Tensor, int]:
    """Elements `lo..hi` of this position's block (flattened) of a tensor stored whole,
    and how many elements were read for them: the whole rows of the tensor's first
    dimension that they span. A column-wise split (`Shard(0)`) reads its own rows alone;
    a row-wise one reads the full width of the rows its range spans."""
    full = placement.full_shape
    starts, shape = placement.block(placement.position)
    if not full:  # a scalar, whole at every position
        return tensors.read_range(name, 0, 1), 1
    per_block_row, per_row = math.prod(shape[1:]), math.prod(full[1:])
    first, last = lo // per_block_row, -(-hi // per_block_row)  # the block's rows spanned
    top = starts[0] + first
    rows = last - first
    values = tensors.read_range(name, top * per_row, (top + rows) * per_row)
    stored = ((top, *([0] * (len(full) - 1))), (rows, *full[1:]))
    wanted = ((top, *starts[1:]), (rows, *shape[1:]))
    part = read_block(wanted, [stored], lambda _: values, values.dtype).view(-1)
    skip = first * per_block_row
    return part[lo - skip : hi - skip], values.numel()


class _Files:
    """The checkpoint's tensors by their stored names, each file opened once."""

    def __init__(self, located: dict[str, Path]):
        self.located = located
        self.handles: dict[Path, SafetensorsFile] = {}

    def handle_for(self, name: str) -> SafetensorsFile:
        file = self.located[name]
        if file not in self.handles:
            self.handles[file] = SafetensorsFile(file)
        return self.handles[file]

    def keys(self) -> list[str]:
        return list(self.located)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.handle_for(name).shape(name)

    def read_range(self, name: str, lo: int, hi: int):
        return self.handle_for(name).read_range(name, lo, hi)

    def read(self, name: str):
        return self.handle_for(name).read(name)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def _never_saved(model: nn.Module, name: str) -> bool:
    """A tensor the Transformers model says its checkpoints leave out (sinusoidal position
    embeddings, which its initialisation computes: Marian's): `from_pretrained` keeps the
    initialised value without a word, and so does this."""
    patterns = [
        *(getattr(model, "_keys_to_ignore_on_save", None) or ()),
        *(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
    ]
    return any(re.search(pattern, name) for pattern in patterns)


def _by_model_names(module: nn.Module, files: _Files):
    """The files as they are, or, for a Transformers model whose checkpoint is in its
    original layout (names the model does not have), converted to the model's names."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers()}
    if set(files.keys()) <= names or not hasattr(module, "base_model_prefix"):
        return files
    from .transformers_layout import TransformersLayout

    return TransformersLayout(module, files.keys(), files.handle_for)
