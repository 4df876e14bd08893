"""Sharded checkpoints that load at any world size and stage.

A checkpoint is a directory:

    index.json                  layout, world size, stage, step, optimizer hyperparameters,
                                and for every parameter which rank file holds which range
    rank00000.safetensors ...   what each rank owned: fp32 master ranges and the matching
                                elementwise optimizer state ("<state>/<name>"), no pickle
    client_state.pt             optional, rank 0: trainer state, torch.load(weights_only=True)

Every range is in the coordinates of the flattened parameter, so the reader needs nothing
of the writer's unit or bucket layout: each rank of the new world computes the ranges its
new shard needs and reads just those slices. A save is atomic: files go to a temporary
directory that is renamed into place once every rank has written and the index is
complete; an interrupted save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout.partition import ParamSlot, Stored
from ..offload.state_store import OptimizerStateStore
from ..optim.optimizer_set import OptimizerSet
from ..tensor_parallel import TensorPlacement, read_block
from ..units.flat_unit import FlatUnit, OneResident
from ..units.optimizer_view import OptimizerView
from . import atomic_dir
from .checksums import CHUNK_BYTES, ChecksumMismatch, chunk_crcs, verified_read
from .safe_load import CheckpointError, safe_torch_load
from .safetensors_io import LazyTensor, SafetensorsFile, lazy
from .save_agreement import (
    attempt,
    client_state_bytes,
    failure_message,
    file_bytes,
    write_rank_file,
)

FORMAT = "zero-strategy/1"
INDEX = "index.json"
MASTER_DTYPES = (torch.float32, torch.float64)  # masters: fp32, or fp64 by fp64 training
CLIENT_STATE = "client_state.pt"
RESTORE = "Restore the checkpoint from where it was written, or load an earlier one."


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class ShardedState:
    """What a checkpoint reads and writes, handed over by the engine."""

    units: list[FlatUnit]
    optimizer: OptimizerSet  # every optimizer of the engine, as one
    views: list[OptimizerView]  # the optimizer's parameters, one per (unit, group) segment
    module: nn.Module  # for its persistent buffers
    world: Communicator  # every rank: barriers and the index exchange
    stage: int
    device: torch.device  # where control tensors go (an NCCL group refuses CPU ones)
    # Where a parameter (unit, name, shape) is stored: a tensor's name, shape and the
    # parameter's offset in it (experts: global ids, or rows of a batched weight).
    stored: Callable[[FlatUnit, str, tuple[int, ...]], Stored]
    model_names: set[str]  # every rank's stored names (other expert-parallel ranks' experts)
    # Where the optimizer's elementwise state is read and put (memory or the disk tier).
    optimizer_state: OptimizerStateStore
    # Tensor parallelism: this rank's position (parameters whole on every position are
    # written by position 0 alone; `world` is then every rank, numbered globally).
    tensor_position: int = 0


@dataclass
class LoadedCheckpoint:
    step: int
    loss_scaler: dict[str, Any]
    client_state: dict | None


# ============================================================================ saving
def _owned_pieces(state: ShardedState) -> Iterator[tuple[FlatUnit, ParamSlot, int, int]]:
    """(unit, slot, lo, hi) for every range of a parameter this rank writes; ranges are in
    flattened-parameter coordinates. Each element is written once: by the ranks of the
    first copy of its unit, or at stage 0 (replicated) by rank 0 alone."""
    for unit in state.units:
        if not unit.group.primary:
            continue
        if state.stage == 0:  # replicated: a copy's first rank writes it (rank 0, or each
            if unit.group.rank != 0:  # expert-parallel rank's first holder of its experts)
                continue
            start, end = 0, unit.layout.padded_numel
        else:
            start, end = unit.layout.shard_range(unit.rank)
        for slot in unit.layout.slots:
            if state.tensor_position and not slot.tensor_sharded:
                continue  # the same values at every tensor-parallel position
            lo, hi = max(start, slot.offset), min(end, slot.end)
            if lo < hi:
                yield unit, slot, lo - slot.offset, hi - slot.offset


def _views_covering(
    views: list[OptimizerView], unit: FlatUnit, lo: int, hi: int
) -> list[OptimizerView]:
    """The optimizer views holding [lo, hi) of `unit`'s slice (slice coordinates), in
    order: one, or several where the views were cut into tiles (offloaded state)."""
    found = sorted(
        (v for v in views if v.unit is unit and v.lo < hi and lo < v.hi and v.hi > v.lo),
        key=lambda v: v.lo,
    )
    at = lo
    for view in found:
        if view.lo > at:
            return []  # a gap: no view holds these elements (a frozen range)
        at = max(at, view.hi)
    return found if at >= hi else []


def _elementwise_state(
    state: ShardedState, unit: FlatUnit, slot: ParamSlot, lo: int, hi: int
) -> dict[str, torch.Tensor]:
    """The optimizer state covering [lo, hi) of `slot`, as 1-D tensors to be read when
    written (from memory, or from the disk tier: one piece in memory at a time)."""
    flat_lo = slot.offset + lo - unit.opt_start
    flat_hi = slot.offset + hi - unit.opt_start
    views = _views_covering(state.views, unit, flat_lo, flat_hi)
    if not views:
        return {}
    store = state.optimizer_state
    dtypes = store.dtypes(views[0])
    if any(store.dtypes(v) != dtypes for v in views[1:]):
        raise CheckpointError(
            f"The optimizer state of '{slot.name}' differs between the pieces it is stepped "
            f"in ({[store.dtypes(v) for v in views]}); every piece of one parameter must "
            "hold the same state. This is a bug: please report it."
        )

    def load(key: str) -> torch.Tensor:  # read when the writer reaches it
        pieces = [
            store.read(v, key, max(flat_lo, v.lo) - v.lo, min(flat_hi, v.hi) - v.lo) for v in views
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    shape = (flat_hi - flat_lo,)
    return {k: LazyTensor(dtype, shape, functools.partial(load, k)) for k, dtype in dtypes.items()}


def _scalar_state(optimizer: OptimizerSet) -> list[dict[str, Any]]:
    """Per param group: non-elementwise state (Adam's `step`), equal for all its segments."""
    groups: list[dict[str, Any]] = [{} for _ in optimizer.param_groups]
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() == 0:
                    groups[gi][k] = {
                        "value": v.item(),
                        "dtype": str(v.dtype).removeprefix("torch."),
                    }
                elif isinstance(v, (int, float)):
                    groups[gi][k] = {"value": v, "dtype": None}
    return groups


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def save(
    state: ShardedState,
    path: str | os.PathLike,
    *,
    step: int,
    compute_dtype: torch.dtype,
    loss_scaler: dict[str, Any],
    client_state: dict | None = None,
) -> None:
    """Write `state` to the directory `path` (collective: every rank calls it). The caller
    has finished its reductions and parameter gathers."""
    world = state.world
    rank = world.rank
    final = Path(path)
    tmp = atomic_dir.staging_dir(final)
    # Offloaded shards are read in unit by unit as the file is written.
    in_memory = OneResident()
    tensors, written, state_keys = _rank_tensors(state, in_memory)
    needed = file_bytes(tensors)
    # 1. Rank 0 clears what an interrupted save left and checks the client state; every
    #    rank learns how much its host's ranks will write.
    error, client_bytes = None, None
    if rank == 0:
        try:
            client_bytes = client_state_bytes(client_state)
            atomic_dir.prepare(final)
        except Exception as e:
            error = failure_message(e, tmp, final)
    first = world.control_all_gather_json(
        {"error": error, "needed": needed, "host": socket.gethostname()}, state.device
    )
    _raise_agreed([r["error"] for r in first], final, tmp if rank == 0 else None)
    needed_here = sum(r["needed"] for r in first if r["host"] == socket.gethostname())

    # 2. Every rank writes its file. The index is built from what each rank reports it
    #    wrote (a rank may own no trainable range of some group: the state keys are the
    #    union over ranks).
    crcs: dict[str, list[int]] = {}  # each tensor's, from the bytes as they are written
    recorded = {name: _recording(name, value, crcs) for name, value in tensors.items()}
    try:
        error = attempt(
            lambda: write_rank_file(recorded, tmp / rank_file(rank), needed_here), tmp, final
        )
    finally:
        in_memory.close()
    tensors.clear()
    recorded.clear()
    everyone = world.control_all_gather_json(
        {
            "wrote": written,
            "keys": sorted(state_keys),
            "scalars": _scalar_state(state.optimizer),
            "crc32": crcs,
            "error": error,
        },
        state.device,
    )
    _raise_agreed([r["error"] for r in everyone], final, tmp if rank == 0 else None)

    # 3. Rank 0 writes the client state and the index, and swaps the directory in.
    error = None
    if rank == 0:
        index = _index(state, everyone, step, compute_dtype, loss_scaler)
        error = attempt(lambda: _finish(tmp, final, index, client_bytes), tmp, final)
    errors = world.control_all_gather_json(error, state.device)
    _raise_agreed(errors, final, tmp if rank == 0 else None)


def _recording(name: str, value: LazyTensor, crcs: dict[str, list[int]]) -> LazyTensor:
    """`value`, whose chunk checksums land in `crcs[name]` when it is produced."""

    def load() -> torch.Tensor:
        tensor = value.load().detach().cpu()  # the bytes written, checked from host memory
        crcs[name] = chunk_crcs(tensor)
        return tensor

    return LazyTensor(value.dtype, value.shape, load)


def _master_piece(in_memory: OneResident, unit: FlatUnit, a: int, b: int) -> LazyTensor:
    """Elements [a, b) of the unit's master, read when written (a copy when the shard is
    offloaded: it leaves memory when the writer moves on to the next unit)."""
    if not unit.master_offloaded:
        return lazy(unit.master[a:b])
    return LazyTensor(unit.master_dtype, (b - a,), lambda: in_memory(unit).master[a:b].clone())


def _rank_tensors(
    state: ShardedState, in_memory: OneResident
) -> tuple[dict[str, LazyTensor], dict[str, dict[str, Any]], set[str]]:
    """What this rank writes: (tensors by name, produced as the file is written; each
    parameter range's index entry; the optimizer's elementwise state keys)."""
    tensors: dict[str, LazyTensor] = {}
    state_keys: set[str] = set()
    written: dict[str, dict[str, Any]] = {}
    for unit, slot, lo, hi in _owned_pieces(state):
        a, b = slot.offset + lo - unit.opt_start, slot.offset + hi - unit.opt_start
        stored = state.stored(unit, slot.name, slot.shape)
        tensors[stored.name] = _master_piece(in_memory, unit, a, b)
        for key, value in _elementwise_state(state, unit, slot, lo, hi).items():
            tensors[f"{key}/{stored.name}"] = value
            state_keys.add(key)
        written[stored.name] = {
            "shape": list(stored.shape),
            # The model's dtype; fp64 when it trained in fp64 (its masters are fp64).
            "dtype": str(
                unit.master_dtype if unit.master_dtype == torch.float64 else slot.dtype
            ).removeprefix("torch."),
            "aliases": [state.stored(unit, a, slot.shape).name for a in slot.aliases],
            "group": slot.group_index,
            "start": stored.offset + lo,
            "end": stored.offset + hi,
        }
        if slot.tensor_sharded:  # stored block after block: each position's, flattened
            written[stored.name]["tensor_parallel"] = {
                "placements": list(slot.tensor.placements),
                "blocks": [[list(a), list(b)] for a, b in slot.tensor.blocks()],
            }
    if state.world.rank == 0:
        for name, buf in persistent_buffers(state.module):
            tensors[f"buffer/{name}"] = lazy(buf)
    return tensors, written, state_keys


def _finish(tmp: Path, final: Path, index: dict[str, Any], client_bytes: bytes | None) -> None:
    """Rank 0's part once every rank file is written: the client state and the index
    (each fsynced), then the directory swapped into place."""
    if client_bytes is not None:
        with open(tmp / CLIENT_STATE, "wb") as f:
            f.write(client_bytes)
            f.flush()
            os.fsync(f.fileno())
    with open(tmp / INDEX, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    atomic_dir.publish(tmp, final)


def _raise_agreed(errors: list[str | None], final: Path, tmp: Path | None) -> None:
    """Every rank raises the first rank's failure (so none waits in a later collective),
    after the half-written staging directory is removed (by the rank given `tmp`)."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    r, message = failed[0]
    raise CheckpointError(f"Saving {final}: rank {r}: {message}")


def _index(
    state: ShardedState,
    reports: list[dict[str, Any]],
    step: int,
    compute_dtype: torch.dtype,
    loss_scaler: dict[str, Any],
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for r, report in enumerate(reports):
        for name, piece in report["wrote"].items():
            kept = ("shape", "dtype", "aliases", "group", "tensor_parallel")
            entry = params.setdefault(
                name, {k: piece[k] for k in kept if k in piece} | {"pieces": []}
            )
            entry["pieces"].append({"rank": r, "start": piece["start"], "end": piece["end"]})
    for entry in params.values():
        entry["pieces"].sort(key=lambda p: p["start"])
    optimizer = state.optimizer
    scalars = [
        {k: v for report in reports for k, v in report["scalars"][gi].items()}
        for gi in range(len(optimizer.param_groups))
    ]
    groups = [
        {k: _json_safe(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    return {
        "format": FORMAT,
        "complete": True,
        "world_size": len(reports),
        "stage": state.stage,
        "step": step,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "files": [rank_file(r) for r in range(len(reports))],
        # CRC-32 of every CHUNK_BYTES of every tensor, by file: loads verify what they read.
        "checksums": {
            "chunk_bytes": CHUNK_BYTES,
            "crc32": {rank_file(r): report["crc32"] for r, report in enumerate(reports)},
        },
        # Each unit's shard groups (data-parallel indices: global ranks without tensor
        # parallelism); the pieces above need none of it to load.
        "units": [
            {
                "name": u.layout.name,
                "shard_groups": u.layout.spec.describe(),
                "replicated": u.layout.spec.replicated,
                "params": [s.name for s in u.layout.slots],
            }
            for u in state.units
        ],
        "params": params,
        "buffers": [name for name, _ in persistent_buffers(state.module)],
        "optimizer": {
            "class": optimizer.name,
            "param_groups": groups,
            "elementwise_state": sorted({k for report in reports for k in report["keys"]}),
            "scalar_state": scalars,
        },
        "loss_scaler": loss_scaler,
    }


# ============================================================================ loading
class CheckpointReader:
    """Reads ranges of parameters and state from a checkpoint directory, opening each
    rank file once and only when a range in it is needed."""

    def __init__(self, path: str | os.PathLike):
        self.path = located(path)
        self.index = read_index(self.path)
        self._files: dict[str, Any] = {}
        # A tensor-parallel block assembled from another layout's blocks, by what it is.
        self._block_key: tuple | None = None
        self._block: torch.Tensor | None = None

    def _open(self, rank: int) -> SafetensorsFile:
        name = rank_file(rank)
        if name not in self._files:
            try:
                self._files[name] = SafetensorsFile(self.path / name)
            except Exception as e:
                raise CheckpointError(
                    f"Cannot read {self.path / name}: {e}. The file is truncated or corrupt; "
                    "restore it or load an earlier checkpoint."
                ) from e
        return self._files[name]

    def read(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str = "",
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        layout: TensorPlacement | None = None,
    ) -> torch.Tensor:
        """Elements [lo, hi) of flattened parameter `name` (or its `prefix` state) in
        `dtype`, read straight into the result (no mmap, no intermediate copy when the
        stored dtype is the same); into `out` (a contiguous tensor of hi - lo elements)
        when given. Masters are stored fp32, or fp64 by fp64 training.

        `layout`: the reader's tensor-parallel placement of the parameter (None: whole),
        in whose stored coordinates [lo, hi) is; a checkpoint written with another one
        is translated (its overlapping blocks read, `TensorPlacement`)."""
        sources = _stored_blocks(self.index["params"][name])
        wanted = None if layout is None or not layout.sharded else layout
        if (wanted.blocks() if wanted else None) != sources:
            return self._translated(name, lo, hi, prefix, out, dtype, wanted, sources)
        return self._read_stored(name, lo, hi, prefix, out, dtype)

    def _translated(self, name, lo, hi, prefix, out, dtype, wanted, sources) -> torch.Tensor:
        """[lo, hi) of this reader's block of `name`, assembled from the stored blocks
        (kept for the next range of the same block)."""
        shape = tuple(self.index["params"][name]["shape"])
        target = wanted.block(wanted.position) if wanted else ((0,) * len(shape), shape)
        key = (name, prefix, target, dtype)
        if self._block_key != key:
            self._block_key, self._block = None, None  # the previous one goes first
            stored = sources or [((0,) * len(shape), shape)]
            offsets = [0]
            for _, block_shape in stored:
                offsets.append(offsets[-1] + math.prod(block_shape))
            self._block = read_block(
                target,
                stored,
                lambda k: self._read_stored(name, offsets[k], offsets[k + 1], prefix, None, dtype),
                dtype,
            ).reshape(-1)
            self._block_key = key
        at = wanted.offset if wanted else 0
        values = self._block[lo - at : hi - at]
        if out is None:
            return values.clone()
        out.copy_(values)
        return out

    def _read_stored(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str,
        out: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        entry = self.index["params"][name]
        if out is None:
            out = torch.empty(hi - lo, dtype=dtype)
        elif out.dtype not in MASTER_DTYPES or out.numel() != hi - lo or not out.is_contiguous():
            raise ValueError(
                f"read(out=...) needs a contiguous fp32 or fp64 tensor of {hi - lo} elements."
            )
        filled = 0
        for piece in entry["pieces"]:
            a, b = max(lo, piece["start"]), min(hi, piece["end"])
            if a >= b:
                continue
            key = f"{prefix}{name}"
            handle = self._open(piece["rank"])
            if key not in handle.tensors or handle.dtype(key) not in MASTER_DTYPES:
                raise CheckpointError(
                    f"{rank_file(piece['rank'])} in {self.path} lacks fp32 '{key}' that "
                    f"{INDEX} says it holds; the index does not match the files. {RESTORE}"
                )
            target = out[a - lo : b - lo]
            crcs = self._crcs(piece["rank"], key)
            try:
                if crcs is not None:
                    verified_read(handle, key, a - piece["start"], b - piece["start"], crcs, target)
                elif handle.dtype(key) == out.dtype:
                    handle.read_range(key, a - piece["start"], b - piece["start"], target)
                else:
                    target.copy_(handle.read_range(key, a - piece["start"], b - piece["start"]))
            except ChecksumMismatch as e:
                raise self._corrupt(piece["rank"], e) from e
            except ValueError as e:
                raise CheckpointError(f"{e}; the index does not match the files. {RESTORE}") from e
            filled += b - a
        if filled != hi - lo:
            raise CheckpointError(
                f"{INDEX} in {self.path} covers {filled} of the {hi - lo} elements [{lo}:{hi}] "
                f"of '{name}': the index does not match the files. {RESTORE}"
            )
        return out

    def holds(self, name: str, prefix: str) -> bool:
        """Whether any rank file holds `prefix` state of `name` (an Adam parameter has no
        "momentum_buffer/", an SGD one no "exp_avg/", when two optimizers were saved)."""
        return any(
            f"{prefix}{name}" in self._open(piece["rank"]).tensors
            for piece in self.index["params"][name]["pieces"]
        )

    def verify(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str = "",
        dtype: torch.dtype = torch.float32,
        layout: TensorPlacement | None = None,
    ) -> None:
        """Read and check [lo, hi) as `read` would, a bounded piece at a time, keeping
        nothing: a load verifies all it will read before it changes the model."""
        if layout is not None and layout.sharded:  # read as it will be, block by block
            self.read(name, lo, hi, prefix, dtype=dtype, layout=layout)
            return
        if _stored_blocks(self.index["params"][name]):  # whole, from blocks
            self.read(name, lo, hi, prefix, dtype=dtype)
            return
        step = 16 * CHUNK_BYTES // 4  # elements per read: 16 MiB of fp32
        scratch = torch.empty(min(step, max(hi - lo, 0)), dtype=dtype)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            self.read(name, a, b, prefix, out=scratch[: b - a], dtype=dtype)

    def buffer(self, name: str) -> torch.Tensor:
        key, handle = f"buffer/{name}", self._open(0)
        crcs = self._crcs(0, key)
        if crcs is None:  # a checkpoint from before checksums
            return handle.read(key)
        shape = handle.shape(key)
        out = torch.empty(math.prod(shape), dtype=handle.dtype(key))
        try:
            return verified_read(handle, key, 0, out.numel(), crcs, out).view(shape)
        except ChecksumMismatch as e:
            raise self._corrupt(0, e) from e

    def _crcs(self, rank: int, key: str) -> list[int] | None:
        checksums = self.index.get("checksums")
        if checksums is None:  # a checkpoint from before checksums
            return None
        if checksums.get("chunk_bytes") != CHUNK_BYTES:
            raise CheckpointError(
                f"{self.path / INDEX} records checksums of {checksums.get('chunk_bytes')}-byte "
                f"chunks; this version verifies {CHUNK_BYTES}-byte ones. Load it with the "
                "zero-strategy version that wrote it."
            )
        crcs = checksums["crc32"].get(rank_file(rank), {}).get(key)
        if crcs is None:
            raise CheckpointError(
                f"{self.path / INDEX} records no checksum for '{key}' in {rank_file(rank)}; "
                f"the index does not match the files. {RESTORE}"
            )
        return crcs

    def _corrupt(self, rank: int, error: ChecksumMismatch) -> CheckpointError:
        return CheckpointError(
            f"{self.path / rank_file(rank)}: {error}. The file is corrupt; restore it or load "
            "an earlier checkpoint."
        )


def located(path: str | os.PathLike) -> Path:
    """The checkpoint at `path`; the previous one when the save that was replacing it was
    killed between its two renames (platforms without an atomic directory swap)."""
    path = Path(path)
    found = atomic_dir.resolve(path)
    if found != path:
        warnings.warn(
            f"{path} is missing and {found.name} beside it is whole: the save that was "
            "replacing it was interrupted. Loading the previous checkpoint; the next save "
            "to this path clears it.",
            stacklevel=3,
        )
    return found


def read_index(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; a zero-strategy checkpoint is one. Pass the "
            f"directory that save_checkpoint wrote (it holds {INDEX})."
        )
    index_path = path / INDEX
    if not index_path.exists():
        raise CheckpointError(
            f"{path} has no {INDEX}: it is not a complete zero-strategy checkpoint (an "
            "interrupted save leaves only a '.tmp' directory). Load a checkpoint written by "
            "engine.save_checkpoint."
        )
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{index_path} is not valid JSON ({e}); the checkpoint is corrupt."
        ) from e
    if index.get("format") != FORMAT or not index.get("complete"):
        raise CheckpointError(f"{index_path} is not a complete '{FORMAT}' index.")
    _check_file_names(path, index)
    missing = [f for f in index["files"] if not (path / f).exists()]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path} is incomplete: missing {missing} (written by ranks "
            f"{[index['files'].index(f) for f in missing]} of {index['world_size']}). {RESTORE}"
        )
    return index


def _check_file_names(path: Path, index: dict[str, Any]) -> None:
    """A checkpoint is untrusted input: its index may name only the rank files of its own
    world size, and none of them may lead out of the directory (through `..`, an absolute
    path, or a symlink)."""
    world = index.get("world_size")
    files = index.get("files")
    if not isinstance(world, int) or world < 1 or not isinstance(files, list):
        raise CheckpointError(f"{path / INDEX} has no valid world_size and files list.")
    expected = [rank_file(r) for r in range(world)]
    if files != expected:
        odd = [f for f in files if f not in expected] or files
        raise CheckpointError(
            f"{path / INDEX} names files {odd[:3]}; a checkpoint of {world} ranks holds exactly "
            f"{expected[:3]}{'...' if world > 3 else ''} in its own directory. Refusing it: "
            f"{RESTORE}"
        )
    root = path.resolve()
    for name in files:
        target = (path / name).resolve()
        if target.parent != root:
            raise CheckpointError(
                f"{path / name} leads out of the checkpoint directory (to {target}); a "
                "checkpoint's files must be in its own directory (copy the files, not links). "
                f"Refusing it: {RESTORE}"
            )


def load(
    state: ShardedState, path: str | os.PathLike, load_optimizer_states: bool = True
) -> LoadedCheckpoint:
    """Fill `state`'s fp32 masters (and optimizer state, and buffers) from `path`, whatever
    world size, stage and groups wrote it; the caller refreshes its compute copies after.
    Without the optimizer states, only the parameters and buffers are read.

    A checkpoint is untrusted input: every rank first reads and verifies all it will load,
    and only when every rank found its part whole is anything written into the model, so
    a refused checkpoint leaves the model as it was, on every rank (collective)."""
    error, reader, client = None, None, None
    try:
        reader = CheckpointReader(path)
        _check_same_model(state, reader.index)
        opt_index = reader.index["optimizer"]
        if load_optimizer_states and opt_index["class"] != state.optimizer.name:
            raise CheckpointError(
                f"The checkpoint's optimizer is {opt_index['class']} but the engine's is "
                f"{state.optimizer.name}; build the same optimizer to resume, or pass "
                "load_optimizer_states=False to load the parameters alone."
            )
        _verify(state, reader, load_optimizer_states)
        client = client_state_of(reader.path)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # a malformed index or an I/O error: refused all the same
        error = f"{path} cannot be loaded ({type(e).__name__}: {e}). {RESTORE}"
    errors = state.world.control_all_gather_json(error, state.device)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, message = failed[0]
        raise CheckpointError(message if r == state.world.rank else f"rank {r}: {message}")
    assert reader is not None
    with OneResident(modified=True) as in_memory:  # offloaded shards: unit by unit
        for unit, name, lo, hi, at, layout in _master_ranges(state):
            values = reader.read(name, lo, hi, dtype=unit.master_dtype, layout=layout)
            in_memory(unit).master[at : at + hi - lo].copy_(values)
    if load_optimizer_states:
        _load_optimizer_state(state, reader)
    for name, buf in persistent_buffers(state.module):
        buf.data.copy_(reader.buffer(name))
    return LoadedCheckpoint(int(reader.index["step"]), reader.index["loss_scaler"], client)


def _master_ranges(
    state: ShardedState,
) -> Iterator[tuple[FlatUnit, str, int, int, int, TensorPlacement | None]]:
    """(unit, stored name, lo, hi, offset in the unit's master, tensor-parallel layout)
    for every parameter range this rank's fp32 master holds."""
    for unit in state.units:
        for slot in unit.layout.slots:
            lo, hi = max(unit.opt_start, slot.offset), min(unit.opt_end, slot.end)
            if lo < hi:
                stored = state.stored(unit, slot.name, slot.shape)
                at = stored.offset - slot.offset
                yield unit, stored.name, at + lo, at + hi, lo - unit.opt_start, slot.tensor


def _state_ranges(
    state: ShardedState, view: OptimizerView
) -> Iterator[tuple[str, int, int, int, TensorPlacement | None]]:
    """(stored name, lo, hi, offset in the view, tensor-parallel layout) for every
    parameter range of `view`."""
    unit = view.unit
    a, b = view.lo + unit.opt_start, view.hi + unit.opt_start  # unit-flat coordinates
    for slot in unit.layout.slots:
        s, e = max(a, slot.offset), min(b, slot.end)
        if s < e:
            stored = state.stored(unit, slot.name, slot.shape)
            at = stored.offset - slot.offset
            yield stored.name, at + s, at + e, s - a, slot.tensor


def _verify(state: ShardedState, reader: CheckpointReader, optimizer_states: bool) -> None:
    """Read (in bounded pieces) and check everything a load will take from the files."""
    for unit, name, lo, hi, _, layout in _master_ranges(state):
        reader.verify(name, lo, hi, dtype=unit.master_dtype, layout=layout)
    keys = reader.index["optimizer"]["elementwise_state"] if optimizer_states else []
    for view in state.views:
        for key in _keys_of(state, reader, view, keys):
            for name, lo, hi, _, layout in _state_ranges(state, view):
                reader.verify(name, lo, hi, f"{key}/", view.unit.master_dtype, layout)
    if optimizer_states:
        _check_optimizer_groups(state, reader.index["optimizer"])
    for name, buf in persistent_buffers(state.module):
        saved = reader.buffer(name)
        if saved.shape != buf.shape:
            raise CheckpointError(
                f"Buffer '{name}' is {tuple(saved.shape)} in the checkpoint and "
                f"{tuple(buf.shape)} in the model: the checkpoint is of another model. "
                "Build the model that wrote it."
            )


def _check_optimizer_groups(state: ShardedState, opt_index: dict[str, Any]) -> None:
    """The saved optimizer's param groups and scalar state fit the engine's optimizer."""
    saved, mine = len(opt_index["param_groups"]), len(state.optimizer.param_groups)
    if saved != mine or len(opt_index["scalar_state"]) != mine:
        raise CheckpointError(
            f"The checkpoint's optimizer has {saved} param groups and the engine's has "
            f"{mine}; build the optimizer with the same groups to resume, or pass "
            "load_optimizer_states=False to load the parameters alone."
        )
    for group in opt_index["scalar_state"]:
        for key, spec in group.items():
            dtype = spec.get("dtype")
            if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise CheckpointError(
                    f"The checkpoint's optimizer state '{key}' has dtype {dtype!r}, which is "
                    f"not a torch dtype: the index is corrupt. {RESTORE}"
                )


def client_state_of(path: str | os.PathLike) -> dict | None:
    """The client state saved with a checkpoint (loaded with weights_only=True), or None."""
    client = atomic_dir.resolve(Path(path)) / CLIENT_STATE
    return safe_torch_load(client) if client.exists() else None


def _load_optimizer_state(state: ShardedState, reader: CheckpointReader) -> None:
    optimizer = state.optimizer
    opt_index = reader.index["optimizer"]
    for group, saved in zip(optimizer.param_groups, opt_index["param_groups"]):
        for k, v in saved.items():
            if (
                k in group
                and isinstance(v, (int, float, bool, type(None)))
                and not isinstance(group[k], torch.Tensor)
            ):
                group[k] = v
    keys = opt_index["elementwise_state"]
    scalars = opt_index["scalar_state"]
    store = state.optimizer_state
    store.clear()
    for view in state.views:
        if not keys and not scalars[view.group_index]:
            continue
        entry: dict[str, Any] = {}
        for k, spec in scalars[view.group_index].items():
            entry[k] = (
                torch.tensor(spec["value"], dtype=getattr(torch, spec["dtype"]))
                if spec["dtype"]
                else spec["value"]
            )
        for key in _keys_of(state, reader, view, keys):
            dtype = view.unit.master_dtype
            buf = torch.empty(view.hi - view.lo, dtype=dtype, device=view.unit.host)
            for name, lo, hi, at, layout in _state_ranges(state, view):
                values = reader.read(name, lo, hi, f"{key}/", dtype=dtype, layout=layout)
                buf[at : at + hi - lo].copy_(values)
            entry[key] = buf
        store.put(view, entry)


def _keys_of(
    state: ShardedState, reader: CheckpointReader, view: OptimizerView, keys: list[str]
) -> list[str]:
    """The elementwise state keys saved for the parameters of `view` (optimizers of
    different kinds keep different ones)."""
    names = [name for name, *_ in _state_ranges(state, view)]
    if not names:  # an empty view (none of the group is this rank's): empty tensors of all
        return keys
    return [k for k in keys if any(reader.holds(name, f"{k}/") for name in names)]


def _stored_blocks(entry: dict[str, Any]) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """A tensor-parallel parameter's stored blocks (None: stored whole)."""
    tp = entry.get("tensor_parallel")
    if tp is None:
        return None
    return [(tuple(a), tuple(b)) for a, b in tp["blocks"]]


def _check_same_model(state: ShardedState, index: dict[str, Any]) -> None:
    saved = index["params"]
    mine = {
        stored.name: stored
        for u in state.units
        for s in u.layout.slots
        for stored in [state.stored(u, s.name, s.shape)]
    }
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - state.model_names)
    mismatched = sorted(
        f"{n}: checkpoint {tuple(saved[n]['shape'])} vs model {tuple(mine[n].shape)}"
        for n in set(mine) & set(saved)
        if tuple(saved[n]["shape"]) != tuple(mine[n].shape)
    )
    if missing or unexpected or mismatched:
        raise CheckpointError(
            "The checkpoint is of another model: "
            f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}; "
            f"shape-mismatched {mismatched[:10]}. Build the model that wrote it."
        )


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf
