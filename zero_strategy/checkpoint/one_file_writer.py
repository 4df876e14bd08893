"""A one-file checkpoint (`state_dict_type="full"`) written by every rank in parallel.

The file is the Lightning checkpoint consolidation writes (`consolidate.py`: the model's
state dict in the masters' precision, each optimizer's whole state keyed by parameter
name, the client state), which `torch.load(weights_only=True)`,
`LightningModule.load_from_checkpoint` and a DDP run open. Nothing is gathered to make it:

1. every rank reports the ranges it owns (as for a sharded save), so every rank knows the
   whole index;
2. rank 0 writes the archive's skeleton, with a hole for every tensor's bytes, and tells
   each rank where its tensors' records start;
3. every rank writes its own ranges of the masters and the optimizer state into those
   holes (the same file, disjoint bytes) and fsyncs them;
4. rank 0 puts each record's CRC together from its parts, checks every byte of every
   record was written once, and renames the file into place.

Each rank's memory holds one piece at a time (offloaded shards are read in unit by unit);
the file needs no sharded copy beside it and no rank reads another's shards. The file
system must let ranks write disjoint ranges of one file: a local disk or a parallel file
system (Lustre, GPFS) does; NFS across nodes may not: save "sharded" there.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from ..units.flat_unit import OneResident
from .consolidate import (
    Entry,
    consolidate,
    entry_skeleton,
    lightning_wrapper,
    plan,
    plan_optimizer,
    resolve_buffers,
)
from .format import ShardedState, persistent_buffers
from .safe_load import CheckpointError
from .safetensors_io import LazyTensor
from .save import build_index, raise_agreed, reported_tensors, save
from .save_agreement import check_safe_load, failure_message
from .torch_archive import (
    Record,
    patch_crcs,
    record_crc,
    tensor_bytes,
    write_at,
)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _refuse_without_room(needed: int, folder: Path, beside: str, sharded_is: str) -> None:
    """Refused before the file is begun when `folder`'s disk cannot hold `needed` bytes,
    naming the sharded form (`sharded_is`: what it spares)."""
    free = free_bytes(folder)
    if needed > free:
        raise CheckpointError(
            f"the file needs about {needed / 2**20:.0f} MiB and the disk has "
            f"{free / 2**20:.0f} MiB free{beside}. Free some space, or save with "
            f"state_dict_type='sharded' ({sharded_is})."
        )


class KnownState:
    """What consolidation's planning asks of a checkpoint (its index, which state each
    parameter has, the client state, the buffers), answered from what the ranks reported
    before anything is written."""

    def __init__(self, path: Path, index: dict, tensor_names: set[str], client, buffers):
        self.path = path
        self.index = index
        self._names = tensor_names  # every rank's tensor names, as a sharded save names them
        self._client = client
        self._buffers = buffers

    def holds(self, name: str, prefix: str) -> bool:
        return f"{prefix}{name}" in self._names

    def client_state(self) -> dict | None:
        return self._client

    def buffer(self, name: str) -> torch.Tensor:
        return self._buffers[name]


def _entries(known: KnownState) -> list[Entry]:
    """What the file holds: the model in its masters' precision, then every optimizer's
    elementwise state (consolidation's plan, so the two writers make the same file)."""
    weights = resolve_buffers(known, plan(known, None, False, masters=True))
    return weights + plan_optimizer(known)


def _source_key(entry: Entry) -> str:
    """The name of the rank tensor an entry's bytes come from (`rank_tensors`' names)."""
    if entry.optimizer_key:
        return entry.name  # "<state>/<name>"
    return entry.source  # the parameter's stored name (each alias), or "buffer/<name>"


def save_one_file(
    state: ShardedState,
    path: str | os.PathLike,
    *,
    step: int,
    compute_dtype: torch.dtype,
    loss_scaler: dict[str, Any],
    client_state: dict | None,
    keys: dict[str, Any] | None = None,
) -> int:
    """Write the one-file checkpoint `path` (collective). `keys`: Fabric's layout (the
    model and each optimizer under the names the user saved them by); Lightning's when
    None. Returns the bytes of tensor data this rank wrote."""
    world, target = state.world, Path(path)
    partial = target.with_name(f".{target.name}.partial")
    rank = world.rank
    meta = dict(step=step, compute_dtype=compute_dtype, loss_scaler=loss_scaler)
    if any(s.tensor_sharded for u in state.units for s in u.layout.slots):
        return _through_a_sharded_copy(state, target, partial, client_state, keys, meta)
    in_memory = OneResident()
    try:
        tensors, written, reports = reported_tensors(state, in_memory)
        index = build_index(state, reports, step, compute_dtype, loss_scaler)
        # 2. Rank 0: the skeleton, and where each rank's tensors go.
        places, error = {}, None
        if rank == 0:
            try:
                places = _write_skeleton(state, index, reports, client_state, partial, keys)
            except Exception as e:
                partial.unlink(missing_ok=True)
                error = failure_message(e, partial, target)
        shared = world.control_all_gather_json({"error": error, "places": places}, state.device)
        raise_agreed([r["error"] for r in shared], target, None)
        places = shared[0]["places"]
        # 3. Every rank: its bytes into the holes.
        parts: list[list] = []
        error = None
        try:
            nbytes = _fill(tensors, written, places, partial, parts)
        except Exception as e:
            error, nbytes = failure_message(e, partial, target), 0
        tensors.clear()
    finally:
        in_memory.close()
    reports = world.control_all_gather_json({"error": error, "parts": parts}, state.device)
    if any(r["error"] for r in reports) and rank == 0:
        partial.unlink(missing_ok=True)
    raise_agreed([r["error"] for r in reports], target, None)
    # 4. Rank 0: the CRCs, every byte accounted for, the file swapped in.
    error = None
    if rank == 0:
        try:
            _finish(partial, target, places, [p for r in reports for p in r["parts"]])
        except Exception as e:
            partial.unlink(missing_ok=True)
            error = failure_message(e, partial, target)
    raise_agreed(world.control_all_gather_json(error, state.device), target, None)
    return nbytes


def _write_skeleton(
    state: ShardedState,
    index: dict[str, Any],
    reports: list[dict[str, Any]],
    client_state: dict | None,
    partial: Path,
    keys: dict[str, Any] | None,
) -> dict[str, Any]:
    """Rank 0: the archive without its tensors' bytes, except those only rank 0 holds
    (tensors of the client state, Adam's step counts), which it writes now. Returns
    {"records": {record: [offset, size]}, "by_source": {rank tensor name: [[record,
    dtype]]}, "written": [[record, start, length, crc]]}."""
    client = dict(client_state) if client_state is not None else None
    buffers = {name: b.detach().cpu() for name, b in persistent_buffers(state.module)}
    names = {n for r in reports for n in r["tensors"]}
    known = KnownState(partial, index, names, client, buffers)
    entries = _entries(known)
    needed = sum(e.nbytes for e in entries)
    partial.parent.mkdir(parents=True, exist_ok=True)  # (Lightning's first checkpoint)
    _refuse_without_room(needed, partial.parent, "", "each rank its own file")
    skeleton = entry_skeleton(entries, lightning_wrapper(known, True, keys), partial)
    # One serialization, checked whole (the client state with it) as a load will read it;
    # the holes read as zeros.
    check_safe_load(lambda: torch.load(partial, weights_only=True, mmap=True))
    by_source: dict[str, list[list]] = {}
    own: list[list] = []
    with open(partial, "r+b") as f:
        for record, entry, tensor in skeleton:
            if entry is not None:
                dtype = str(entry.dtype).removeprefix("torch.")
                by_source.setdefault(_source_key(entry), []).append([record.name, dtype])
                continue
            data = tensor_bytes(tensor)  # a real tensor of the client or optimizer state
            write_at(f.fileno(), data, record.offset)
            own.append([record.name, 0, len(data), zlib.crc32(data)])
    return {
        "records": {r.name: [r.offset, r.size] for r, _, _ in skeleton},
        "by_source": by_source,
        "written": own,
    }


def _fill(
    tensors: dict[str, LazyTensor],
    written: dict[str, dict[str, Any]],
    places: dict[str, Any],
    partial: Path,
    parts: list[list],
) -> int:
    """This rank's tensors into their records (every alias's, in its dtype); each part's
    (record, start, length, CRC) appended to `parts`. The bytes written."""
    records, by_source = places["records"], places["by_source"]
    total = 0
    fd = os.open(partial, os.O_WRONLY)
    try:
        for name, lazy in tensors.items():
            targets = by_source.get(name)
            if not targets:
                continue  # (an EMA: not in the file, as consolidation leaves it)
            stored = name.split("/", 1)[1] if "/" in name else name
            first = 0 if name.startswith("buffer/") else written[stored]["start"]
            values = lazy.load().detach().cpu()
            for record, dtype in targets:
                converted = values.to(getattr(torch, dtype))
                data = tensor_bytes(converted)
                start = first * converted.element_size()
                offset, _ = records[record]
                write_at(fd, data, offset + start)
                parts.append([record, start, len(data), zlib.crc32(data)])
                total += len(data)
            del values
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def _finish(partial: Path, target: Path, places: dict[str, Any], parts: list[list]) -> None:
    """Rank 0, once every rank has written: each record's CRC from its parts (which must
    cover it exactly), then the file renamed into place."""
    by_record: dict[str, list[tuple[int, int, int]]] = {name: [] for name in places["records"]}
    for record, start, length, crc in [*places["written"], *parts]:
        by_record[record].append((start, length, crc))
    crcs = {
        name: record_crc(by_record[name], Record(name, offset, size))
        for name, (offset, size) in places["records"].items()
    }
    patch_crcs(partial, crcs)
    os.replace(partial, target)


def _through_a_sharded_copy(
    state: ShardedState,
    target: Path,
    partial: Path,
    client_state: dict | None,
    keys: dict[str, Any] | None,
    meta: dict[str, Any],
) -> int:
    """Tensor-parallel blocks are not contiguous ranges of the whole tensor (a column
    shard is every row's slice): the ranks write a sharded copy beside the target, rank 0
    streams it into the file (one tensor in memory at a time) and removes the copy."""
    staging = target.with_name(f".{target.name}.sharded")
    save(state, staging, client_state=client_state, **meta)
    error = None
    if state.world.rank == 0:
        try:
            needed = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
            beside = " beside the sharded copy it is written from"
            _refuse_without_room(needed, target.parent, beside, "no copy")
            consolidate(
                staging, partial, "lightning", with_optimizer=True, show_progress=False, keys=keys
            )
            os.replace(partial, target)
        except Exception as e:
            partial.unlink(missing_ok=True)
            error = failure_message(e, partial, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    raise_agreed(state.world.control_all_gather_json(error, state.device), target, None)
    return 0
