"""Loading a sharded checkpoint into an engine of any world size and stage: the checks that
it is whole and of the same model, then the masters and the optimizer state by ranges."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..tensor_parallel import TensorPlacement
from ..units.flat_unit import FlatUnit, OneResident
from ..units.optimizer_view import OptimizerView
from . import atomic_dir
from .format import (
    RESTORE,
    LoadedCheckpoint,
    ShardedState,
    param_order,
    persistent_buffers,
    slots_by_name,
)
from .one_file import OneFileReader
from .read import CheckpointReader, client_state_in
from .safe_load import CheckpointError
from .state_keys import keys_of_group
from .step_lags_index import checked_step_lags

Reader = CheckpointReader | OneFileReader


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
        buffer_names = {name for name, _ in persistent_buffers(state.module)}
        reader = open_reader(path, buffer_names, param_order(state))
        _check_same_model(state, reader.index)
        if load_optimizer_states and reader.optimizer_error:
            raise CheckpointError(reader.optimizer_error)
        opt_index = reader.index["optimizer"]
        known = opt_index["class"] is not None  # a one-file checkpoint may not say
        if load_optimizer_states and known and opt_index["class"] != state.optimizer.name:
            raise CheckpointError(
                f"The checkpoint's optimizer is {opt_index['class']} but the engine's is "
                f"{state.optimizer.name}; build the same optimizer to resume, or pass "
                "load_optimizer_states=False to load the parameters alone."
            )
        _verify(state, reader, load_optimizer_states)
        client = reader.client_state()
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


def open_reader(
    path: str | os.PathLike, buffer_names: set[str], order: list[list[str]] | None = None
) -> Reader:
    """The reader of a sharded checkpoint directory, or of a one-file checkpoint (whose
    optimizer state, if keyed by position, is matched to the names in `order`)."""
    if Path(path).is_file():
        return OneFileReader(path, buffer_names, order)
    return CheckpointReader(path)


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


def state_ranges(
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


def _verify(state: ShardedState, reader: Reader, optimizer_states: bool) -> None:
    """Read (in bounded pieces) and check everything a load will take from the files."""
    for unit, name, lo, hi, _, layout in _master_ranges(state):
        reader.verify(name, lo, hi, dtype=unit.master_dtype, layout=layout)
    keys = reader.index["optimizer"]["elementwise_state"] if optimizer_states else []
    for view in state.views:
        for stored_key, _ in _keys_of(state, reader, view, keys):
            for name, lo, hi, _, layout in state_ranges(state, view):
                reader.verify(name, lo, hi, f"{stored_key}/", view.unit.master_dtype, layout)
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
    checked_step_lags(opt_index)
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
    return client_state_in(atomic_dir.resolve(Path(path)))


def _load_optimizer_state(state: ShardedState, reader: Reader) -> None:
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
        for stored_key, key in _keys_of(state, reader, view, keys):
            dtype = view.unit.master_dtype
            buf = torch.empty(view.hi - view.lo, dtype=dtype, device=view.unit.host)
            for name, lo, hi, at, layout in state_ranges(state, view):
                values = reader.read(name, lo, hi, f"{stored_key}/", dtype=dtype, layout=layout)
                buf[at : at + hi - lo].copy_(values)
            entry[key] = buf
        store.put(view, entry)
    state.step_lags.load(checked_step_lags(opt_index), slots_by_name(state))


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


def _keys_of(
    state: ShardedState, reader: Reader, view: OptimizerView, keys: list[str]
) -> list[tuple[str, str]]:
    """(stored key, state key) of the elementwise state saved for the parameters of
    `view` (optimizers of different kinds keep different ones; a later optimizer's state
    of a parameter that an earlier one steps too is stored under a marked key)."""
    first = view.group_index if view.alias_of is None else view.alias_of
    mine = keys_of_group(keys, view.group_index, first)
    names = [name for name, *_ in state_ranges(state, view)]
    if not names:  # an empty view (none of the group is this rank's): empty tensors of all
        return mine
    return [(s, k) for s, k in mine if any(reader.holds(name, f"{s}/") for name in names)]
