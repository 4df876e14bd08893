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

import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from .safetensors_io import SafetensorsFile

if TYPE_CHECKING:
    from .engine import ZeroEngine

FORMAT = "zero-strategy/1"
INDEX = "index.json"
CLIENT_STATE = "client_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, incomplete, corrupt or of another model."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ============================================================================ saving
def _owned_pieces(engine: ZeroEngine, rank: int) -> Iterator[tuple[Any, Any, int, int]]:
    """(unit, slot, lo, hi) for every range of a parameter that `rank` writes; ranges are
    in flattened-parameter coordinates. Stage 0 is replicated: rank 0 writes everything."""
    for unit in engine.units:
        if engine.config.stage == 0:
            if rank != 0:
                continue
            start, end = 0, unit.layout.padded_numel
        else:
            start, end = unit.layout.shard_range(rank)
        for slot in unit.layout.slots:
            lo, hi = max(start, slot.offset), min(end, slot.end)
            if lo < hi:
                yield unit, slot, lo - slot.offset, hi - slot.offset


def _state_by_segment(engine: ZeroEngine) -> dict[tuple[int, int], tuple[int, dict]]:
    """(unit index, segment start within the rank's range) -> (segment end, state dict)."""
    out = {}
    for unit, lo, hi, opt_param in engine._opt_views:
        out[(unit.layout.index, lo)] = (hi, engine.optimizer.state.get(opt_param, {}))
    return out


def _elementwise_state(
    engine: ZeroEngine, unit, slot, lo: int, hi: int, segments
) -> dict[str, torch.Tensor]:
    """The optimizer state tensors covering [lo, hi) of `slot`, as 1-D slices."""
    flat_lo = slot.offset + lo - unit.opt_start
    flat_hi = slot.offset + hi - unit.opt_start
    for (uidx, seg_lo), (seg_hi, state) in segments.items():
        if uidx == unit.layout.index and seg_lo <= flat_lo and flat_hi <= seg_hi:
            return {
                k: v[flat_lo - seg_lo : flat_hi - seg_lo]
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == seg_hi - seg_lo
            }
    return {}


def _scalar_state(engine: ZeroEngine) -> list[dict[str, Any]]:
    """Per param group: non-elementwise state (Adam's `step`), equal for all its segments."""
    groups: list[dict[str, Any]] = [{} for _ in engine.optimizer.param_groups]
    for gi, group in enumerate(engine.optimizer.param_groups):
        for p in group["params"]:
            for k, v in engine.optimizer.state.get(p, {}).items():
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


def save(engine: ZeroEngine, path: str | os.PathLike, client_state: dict | None = None) -> None:
    """Write `engine`'s state to the directory `path` (collective: every rank calls it)."""
    engine.wait_for_parameters()
    engine.reducer.wait()
    rank, world = engine.dp.rank, engine.dp.world_size
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(engine)

    segments = _state_by_segment(engine)
    tensors: dict[str, torch.Tensor] = {}
    state_keys: set[str] = set()
    for unit, slot, lo, hi in _owned_pieces(engine, rank):
        a, b = slot.offset + lo - unit.opt_start, slot.offset + hi - unit.opt_start
        tensors[slot.name] = unit.master[a:b]
        for key, value in _elementwise_state(engine, unit, slot, lo, hi, segments).items():
            tensors[f"{key}/{slot.name}"] = value
            state_keys.add(key)
    if rank == 0:
        for name, buf in persistent_buffers(engine.module):
            tensors[f"buffer/{name}"] = buf
    # Slices of one master buffer share storage, which safetensors refuses: copy them.
    save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, tmp / rank_file(rank))
    del tensors
    # A rank may own no trainable range of some group: take the union over ranks.
    everyone = _all_gather_json(
        engine, {"keys": sorted(state_keys), "scalars": _scalar_state(engine)}
    )
    keys = sorted({k for e in everyone for k in e["keys"]})
    scalars = [
        {k: v for e in everyone for k, v in e["scalars"][gi].items()}
        for gi in range(len(engine.optimizer.param_groups))
    ]
    _barrier(engine)

    if rank == 0:
        if client_state is not None:
            torch.save(client_state, tmp / CLIENT_STATE)
        index = _index(engine, world, keys, scalars)
        with open(tmp / INDEX, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = final.with_name(final.name + ".old")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    _barrier(engine)


def _all_gather_json(engine: ZeroEngine, value: Any) -> list[Any]:
    """Every rank's JSON-able `value`, exchanged as bytes (no pickle)."""
    if not engine.dp.distributed:
        return [value]
    # On the engine's device: its group is NCCL-only on CUDA, which refuses CPU tensors.
    device = engine.device
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=engine.dp.group)
    padded = torch.zeros(int(size), dtype=torch.uint8)
    padded[: data.numel()] = data
    out = torch.empty(engine.dp.world_size * int(size), dtype=torch.uint8, device=device)
    dist.all_gather_single(out, padded.to(device), group=engine.dp.group)
    return [
        json.loads(bytes(chunk.tolist()).rstrip(b"\0"))
        for chunk in out.cpu().chunk(engine.dp.world_size)
    ]


def _index(
    engine: ZeroEngine, world: int, state_keys: list[str], scalars: list[dict[str, Any]]
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for r in range(world):
        for _unit, slot, lo, hi in _owned_pieces(engine, r):
            entry = params.setdefault(
                slot.name,
                {
                    "shape": list(slot.shape),
                    "dtype": str(slot.dtype).removeprefix("torch."),
                    "aliases": list(slot.aliases),
                    "group": slot.group_index,
                    "pieces": [],
                },
            )
            entry["pieces"].append({"rank": r, "start": lo, "end": hi})
    groups = [
        {k: _json_safe(v) for k, v in g.items() if k != "params"}
        for g in engine.optimizer.param_groups
    ]
    return {
        "format": FORMAT,
        "complete": True,
        "world_size": world,
        "stage": engine.config.stage,
        "ep_size": 1,
        "global_expert_ids": [],
        "step": engine.global_steps,
        "compute_dtype": str(engine.config.compute_torch_dtype).removeprefix("torch."),
        "files": [rank_file(r) for r in range(world)],
        "params": params,
        "buffers": [name for name, _ in persistent_buffers(engine.module)],
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_groups": groups,
            "elementwise_state": state_keys,
            "scalar_state": scalars,
        },
        "loss_scaler": engine.scaler.state_dict(),
    }


# ============================================================================ loading
class CheckpointReader:
    """Reads ranges of parameters and state from a checkpoint directory, opening each
    rank file once and only when a range in it is needed."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.index = read_index(self.path)
        self._files: dict[str, Any] = {}

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
        self, name: str, lo: int, hi: int, prefix: str = "", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements [lo, hi) of flattened parameter `name` (or its `prefix` state), fp32,
        read straight into the result (no mmap, no intermediate copy); into `out` (a
        contiguous fp32 tensor of hi - lo elements) when given."""
        entry = self.index["params"][name]
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.numel() != hi - lo or not out.is_contiguous():
            raise ValueError(f"read(out=...) needs a contiguous fp32 tensor of {hi - lo} elements.")
        filled = 0
        for piece in entry["pieces"]:
            a, b = max(lo, piece["start"]), min(hi, piece["end"])
            if a >= b:
                continue
            key = f"{prefix}{name}"
            handle = self._open(piece["rank"])
            if key not in handle.tensors or handle.dtype(key) != torch.float32:
                raise CheckpointError(
                    f"{rank_file(piece['rank'])} in {self.path} lacks fp32 '{key}' that "
                    f"{INDEX} says it holds; the index does not match the files."
                )
            try:
                handle.read_range(key, a - piece["start"], b - piece["start"], out[a - lo : b - lo])
            except ValueError as e:
                raise CheckpointError(f"{e}; the index does not match the files.") from e
            filled += b - a
        if filled != hi - lo:
            raise CheckpointError(
                f"{INDEX} in {self.path} covers {filled} of the {hi - lo} elements [{lo}:{hi}] "
                f"of '{name}': the index does not match the files."
            )
        return out

    def buffer(self, name: str) -> torch.Tensor:
        return self._open(0).read(f"buffer/{name}")


def read_index(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; a zero-strategy checkpoint is one.")
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
    missing = [f for f in index["files"] if not (path / f).exists()]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path} is incomplete: missing {missing} (written by ranks "
            f"{[index['files'].index(f) for f in missing]} of {index['world_size']})."
        )
    return index


def load(
    engine: ZeroEngine, path: str | os.PathLike, load_optimizer_states: bool = True
) -> dict | None:
    """Restore `engine` from `path`, whatever world size and stage wrote it; returns the
    client state, if any (loaded with weights_only=True). Without the optimizer states,
    only the parameters and buffers are read; the optimizer and loss scale are left."""
    engine.wait_for_parameters()
    reader = CheckpointReader(path)
    index = reader.index
    _check_same_model(engine, index)
    opt_index = index["optimizer"]
    if load_optimizer_states and opt_index["class"] != type(engine.optimizer).__name__:
        raise CheckpointError(
            f"The checkpoint's optimizer is {opt_index['class']} but the engine's is "
            f"{type(engine.optimizer).__name__}; build the same optimizer to resume."
        )
    for unit in engine.units:
        for slot in unit.layout.slots:
            lo, hi = max(unit.opt_start, slot.offset), min(unit.opt_end, slot.end)
            if lo < hi:
                values = reader.read(slot.name, lo - slot.offset, hi - slot.offset)
                unit.master[lo - unit.opt_start : hi - unit.opt_start].copy_(values)
    if load_optimizer_states:
        _load_optimizer_state(engine, reader)
    for name, buf in persistent_buffers(engine.module):
        buf.data.copy_(reader.buffer(name))
    engine.refresh_from_masters()
    if load_optimizer_states:
        engine.scaler.load_state_dict(index["loss_scaler"])
        engine.global_steps = int(index["step"])
    client = Path(path) / CLIENT_STATE
    if not client.exists():
        return None
    try:
        return torch.load(client, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{client} holds objects that safe loading (weights_only=True) refuses, so it was "
            f"not executed: {str(e).splitlines()[0]}. Save only tensors, numbers, strings, "
            "lists and dicts as client state."
        ) from e


def _load_optimizer_state(engine: ZeroEngine, reader: CheckpointReader) -> None:
    opt_index = reader.index["optimizer"]
    for group, saved in zip(engine.optimizer.param_groups, opt_index["param_groups"]):
        for k, v in saved.items():
            if (
                k in group
                and isinstance(v, (int, float, bool, type(None)))
                and not isinstance(group[k], torch.Tensor)
            ):
                group[k] = v
    keys = opt_index["elementwise_state"]
    scalars = opt_index["scalar_state"]
    engine.optimizer.state.clear()
    for unit, lo, hi, opt_param in engine._opt_views:
        gi = next(
            i
            for i, g in enumerate(engine.optimizer.param_groups)
            if any(p is opt_param for p in g["params"])
        )
        if not keys and not scalars[gi]:
            continue
        state: dict[str, Any] = {}
        for k, spec in scalars[gi].items():
            state[k] = (
                torch.tensor(spec["value"], dtype=getattr(torch, spec["dtype"]))
                if spec["dtype"]
                else spec["value"]
            )
        for key in keys:
            buf = torch.empty(hi - lo, dtype=torch.float32, device=engine.device)
            a, b = lo + unit.opt_start, hi + unit.opt_start  # unit-flat coordinates
            for slot in unit.layout.slots:
                s, e = max(a, slot.offset), min(b, slot.end)
                if s < e:
                    buf[s - a : e - a].copy_(
                        reader.read(slot.name, s - slot.offset, e - slot.offset, f"{key}/")
                    )
            state[key] = buf
        engine.optimizer.state[opt_param] = state


def _check_same_model(engine: ZeroEngine, index: dict[str, Any]) -> None:
    saved = index["params"]
    mine = {s.name: s for u in engine.units for s in u.layout.slots}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
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


def _barrier(engine: ZeroEngine) -> None:
    if engine.dp.distributed:
        dist.barrier(group=engine.dp.group)
