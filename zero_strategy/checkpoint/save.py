"""Writing a sharded checkpoint: every rank its file of owned ranges, rank 0 the index,
the directory renamed into place once every rank has written (`format` says what is in it)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch

from ..layout.partition import ParamSlot
from ..optim.optimizer_set import OptimizerSet
from ..units.flat_unit import FlatUnit, OneResident
from . import atomic_dir
from .checksums import CHUNK_BYTES, chunk_crcs
from .format import (
    CLIENT_STATE,
    FORMAT,
    INDEX,
    ShardedState,
    owned_pieces,
    param_order,
    persistent_buffers,
    rank_file,
    step_lags_by_name,
    views_covering,
)
from .safe_load import CheckpointError
from .safetensors_io import LazyTensor, lazy
from .save_agreement import (
    attempt,
    client_state_bytes,
    failure_message,
    file_bytes,
    write_rank_file,
)
from .state_keys import state_key


def _elementwise_state(
    state: ShardedState, unit: FlatUnit, slot: ParamSlot, lo: int, hi: int, group: int
) -> dict[str, torch.Tensor]:
    """Param group `group`'s optimizer state covering [lo, hi) of `slot`, as 1-D tensors
    to be read when written (from memory, or from the disk tier: one piece in memory at
    a time)."""
    flat_lo = slot.offset + lo - unit.opt_start
    flat_hi = slot.offset + hi - unit.opt_start
    views = views_covering(state.views, unit, flat_lo, flat_hi, group)
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


def scalar_state(optimizer: OptimizerSet) -> list[dict[str, Any]]:
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


def _merged_order(reports: list[dict[str, Any]], groups: int) -> list[list[str]]:
    """Every rank's names per group (expert-parallel ranks hold different experts), each
    once, rank 0's order first."""
    return [
        list(dict.fromkeys(name for report in reports for name in report["order"][g]))
        for g in range(groups)
    ]


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
    tensors, written, state_keys = rank_tensors(state, in_memory)
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
    raise_agreed([r["error"] for r in first], final, tmp if rank == 0 else None)
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
        {**owned_report(state, written, state_keys), "crc32": crcs, "error": error},
        state.device,
    )
    raise_agreed([r["error"] for r in everyone], final, tmp if rank == 0 else None)

    # 3. Rank 0 writes the client state and the index, and swaps the directory in.
    error = None
    if rank == 0:
        index = build_index(state, everyone, step, compute_dtype, loss_scaler)
        error = attempt(lambda: _finish(tmp, final, index, client_bytes), tmp, final)
    errors = world.control_all_gather_json(error, state.device)
    raise_agreed(errors, final, tmp if rank == 0 else None)


def owned_report(
    state: ShardedState, written: dict[str, dict[str, Any]], state_keys: set[str]
) -> dict[str, Any]:
    """What this rank tells the others of what it owns (`rank_tensors`' ranges and state
    keys, the scalar state, its parameters' order): every rank's make the index."""
    return {
        "wrote": written,
        "keys": sorted(state_keys),
        "scalars": scalar_state(state.optimizer),
        "step_lags": step_lags_by_name(state),
        "order": param_order(state),
    }


def reported_tensors(
    state: ShardedState, in_memory: OneResident
) -> tuple[dict[str, LazyTensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """This rank's tensors and ranges (`rank_tensors`), and every rank's report of them
    (collective): what the writers of whole tensors (one file, or memory) plan from."""
    tensors, written, state_keys = rank_tensors(state, in_memory)
    reports = state.world.control_all_gather_json(
        {**owned_report(state, written, state_keys), "tensors": sorted(tensors), "crc32": {}},
        state.device,
    )
    return tensors, written, reports


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


def rank_tensors(
    state: ShardedState, in_memory: OneResident
) -> tuple[dict[str, LazyTensor], dict[str, dict[str, Any]], set[str]]:
    """What this rank writes: (tensors by name, produced as the file is written; each
    parameter range's index entry; the optimizer's elementwise state keys)."""
    tensors: dict[str, LazyTensor] = {}
    state_keys: set[str] = set()
    written: dict[str, dict[str, Any]] = {}
    for unit, slot, lo, hi in owned_pieces(state):
        a, b = slot.offset + lo - unit.opt_start, slot.offset + hi - unit.opt_start
        stored = state.stored(unit, slot.name, slot.shape)
        tensors[stored.name] = _master_piece(in_memory, unit, a, b)
        for group in slot.groups:  # a later optimizer's state of it too, marked
            for key, value in _elementwise_state(state, unit, slot, lo, hi, group).items():
                key = state_key(key, group, slot.group_index)
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
        if slot.later_groups:
            written[stored.name]["later_groups"] = list(slot.later_groups)
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


def raise_agreed(errors: list[str | None], final: Path, tmp: Path | None) -> None:
    """Every rank raises the first rank's failure (so none waits in a later collective),
    after the half-written staging directory is removed (by the rank given `tmp`)."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    r, message = failed[0]
    raise CheckpointError(f"Saving {final}: rank {r}: {message}")


def build_index(
    state: ShardedState,
    reports: list[dict[str, Any]],
    step: int,
    compute_dtype: torch.dtype,
    loss_scaler: dict[str, Any],
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for r, report in enumerate(reports):
        for name, piece in report["wrote"].items():
            kept = ("shape", "dtype", "aliases", "group", "later_groups", "tensor_parallel")
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
    lags: list[dict[str, int]] = [{} for _ in optimizer.param_groups]
    for report in reports:  # the ranks holding parts of one parameter agree
        for gi, by_name in enumerate(report.get("step_lags", ())):
            for name, lag in by_name.items():
                lags[gi][name] = max(lag, lags[gi].get(name, 0))
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
            # Per group, how many of its steps a parameter missed (no gradient on any
            # rank): its own step count is the group's less that (torch's, per parameter).
            "step_lags": lags,
            # Each group's parameters in the optimizer's order, and how many groups each
            # of the engine's optimizers has (a one-file checkpoint's optimizer_states).
            "param_names": _merged_order(reports, len(optimizer.param_groups)),
            "groups_per_optimizer": [len(opt.param_groups) for opt in optimizer.optimizers],
        },
        "loss_scaler": loss_scaler,
    }
