"""A one-file checkpoint read as a sharded one: a Lightning checkpoint written whole
(`state_dict_type="full"`), or any `torch.save` of `{"state_dict": ..., "optimizer_states":
[...]}` whose optimizer state is keyed by parameter name (FSDP's full form and ours) or,
as torch's `optimizer.state_dict()` keys it, by position (DDP's and a plain run's): each
group's positions are then matched, in order, to the engine's optimizer's parameters, as
torch's own `load_state_dict` matches them.

`OneFileReader` answers what the sharded load asks of `CheckpointReader` (its index, and
ranges of a parameter or of its optimizer state), so a one-file checkpoint loads into any
world size, stage and tensor-parallel layout by the same code. The file is opened with
`mmap=True` and `weights_only=True`: each rank's memory holds the pages of the ranges it
reads, not the model, and nothing in the file runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..layout.partition import FROZEN_GROUP
from ..optim.step_lag import COUNT
from ..tensor_parallel import TensorPlacement
from .safe_load import CheckpointError, safe_torch_load
from .state_keys import state_key

# Where a one-file checkpoint written by this project keeps what a Lightning checkpoint
# has no place for (read back by `OneFileReader`; Lightning ignores the key).
ENGINE_KEY = "zero_strategy"
# A Lightning checkpoint's client-state entry naming the key its model is under, where a
# callback moved it from "state_dict" (`integrations/lightning_model_state.py`).
MODEL_AT = "zero_strategy_model_at"


def _layout(checkpoint: Any) -> tuple[str, list[str | None] | None, set[str]]:
    """Where a one-file checkpoint keeps its model and optimizers (this engine's entry
    says; Lightning's layout without one): the model's key, the optimizers' keys (None:
    Lightning's list under "optimizer_states"), and every key that is not client state."""
    engine = checkpoint.get(ENGINE_KEY, {}) if isinstance(checkpoint, dict) else {}
    model_key = engine.get("model_key", "state_dict")
    optimizer_keys = engine.get("optimizer_keys")
    if optimizer_keys is None:
        named = ["optimizer_states"]
    else:
        named = [k for k in optimizer_keys if k is not None]
    return model_key, optimizer_keys, {model_key, ENGINE_KEY, *named}


def split_one_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A one-file checkpoint's model state dict, and the rest of it (the client state:
    neither the model, nor an optimizer, nor this engine's entry), for a plain module
    (Fabric's load into a module it never set up). Read with weights_only=True and
    mmap=True: the tensors are read as they are copied into the module."""
    checkpoint = safe_torch_load(path, mmap=True)
    model_key, _, whole_keys = _layout(checkpoint)
    if not isinstance(checkpoint, dict) or model_key not in checkpoint:
        raise CheckpointError(
            f"{path} holds no model state dict under {model_key!r}: pass a checkpoint a "
            "save wrote (a sharded directory, or one file with the model in it)."
        )
    return checkpoint[model_key], {k: v for k, v in checkpoint.items() if k not in whole_keys}


class OneFileReader:
    """A one-file checkpoint with `CheckpointReader`'s interface. `buffer_names`: the
    model's persistent buffers, which the file's state dict holds beside the parameters."""

    def __init__(
        self,
        path: str | os.PathLike,
        buffer_names: set[str],
        order: list[list[str]] | None = None,
    ):
        self.path = Path(path)
        self._order = order  # per param group, the engine's parameter names in order
        self.checkpoint = safe_torch_load(self.path, mmap=True)
        model_key, optimizer_keys, self._whole_keys = _layout(self.checkpoint)
        engine = self.checkpoint.get(ENGINE_KEY, {}) if isinstance(self.checkpoint, dict) else {}
        if not isinstance(self.checkpoint, dict) or model_key not in self.checkpoint:
            raise CheckpointError(
                f"{self.path} is not a checkpoint this engine can load: a one-file checkpoint "
                "is a dict with a 'state_dict' (and 'optimizer_states' to resume), as "
                "Lightning writes it. Pass the directory a sharded save wrote, or such a file."
            )
        if optimizer_keys is None:  # Lightning's layout: a list under one key
            optimizers = self.checkpoint.get("optimizer_states")
        else:  # Fabric's: each optimizer under the name it was saved by
            optimizers = [self.checkpoint[k] for k in optimizer_keys if k is not None]
        self._weights: dict[str, torch.Tensor] = self.checkpoint[model_key]
        self._state: dict[str, dict[str, torch.Tensor]] = {}  # name -> key -> tensor
        # Parameters of a stepped group that have taken no step (torch keeps no state
        # for them): that group's stored state keys, read as zeros.
        self._unstepped: dict[str, set[str]] = {}
        # Why the optimizer state cannot be resumed (raised only by a load that asks for
        # it: the weights alone still load).
        self.optimizer_error: str | None = None
        try:
            groups, scalars, names, lags = self._read_optimizer(optimizers)
        except CheckpointError as e:
            self.optimizer_error = str(e)
            self._state.clear()
            self._unstepped.clear()
            groups, scalars, names, lags = [], [], [], []
        group_of: dict[str, int] = {}  # several optimizers' parameter: the first's group
        for g, members in enumerate(names):
            for name in members:
                group_of.setdefault(name, g)
        params = {
            name: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "group": group_of.get(name, FROZEN_GROUP),
                "aliases": [],
            }
            for name, t in self._weights.items()
            if name not in buffer_names
        }
        self.index: dict[str, Any] = {
            "params": params,
            "buffers": [name for name in self._weights if name in buffer_names],
            "step": engine.get("step", self.checkpoint.get("global_step", 0)),
            "loss_scaler": engine.get("loss_scaler", {}),
            "optimizer": {
                "class": engine.get("optimizer_class"),  # unknown for another writer's file
                "param_groups": groups,
                "elementwise_state": sorted({k for s in self._state.values() for k in s}),
                "scalar_state": scalars,
                "step_lags": lags,
                "param_names": names,
            },
        }

    def _read_optimizer(
        self, states: Any
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[list[str]], list[dict[str, int]]]:
        """(each group's hyperparameters, its scalar state, its parameters' names, how
        many steps each parameter is behind the group's count), and every parameter's
        elementwise state into `_state`. torch counts steps per parameter: a group's count
        is its parameters' largest, and one with no state has taken none."""
        groups: list[dict[str, Any]] = []
        scalars: list[dict[str, Any]] = []
        names: list[list[str]] = []
        lags: list[dict[str, int]] = []
        first_group: dict[str, int] = {}  # a parameter that two optimizers step: the first's
        for optimizer in states or []:
            for group in optimizer["param_groups"]:
                members = list(group["params"])
                by_position = any(not isinstance(m, str) for m in members)
                named = self._named(members, len(groups)) if by_position else members
                groups.append({k: v for k, v in group.items() if k != "params"})
                names.append(named)
                scalar: dict[str, Any] = {}
                counts: dict[str, float] = {}
                stored_keys: set[str] = set()
                g = len(groups) - 1
                for member, name in zip(members, named):
                    first = first_group.setdefault(name, g)
                    for key, value in optimizer["state"].get(member, {}).items():
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            stored = state_key(key, g, first)
                            self._state.setdefault(name, {})[stored] = value
                            stored_keys.add(stored)
                            continue
                        if isinstance(value, torch.Tensor):
                            dtype = str(value.dtype).removeprefix("torch.")
                            spec = {"value": value.item(), "dtype": dtype}
                        else:
                            spec = {"value": value, "dtype": None}
                        if key == COUNT:
                            counts[name] = spec["value"]
                            if spec["value"] < scalar.get(key, spec)["value"]:
                                continue  # the group's count: the largest
                        scalar[key] = spec
                scalars.append(scalar)
                lags.append(self._lags(named, counts, stored_keys))
        return groups, scalars, names, lags

    def _lags(
        self, named: list[str], counts: dict[str, float], stored_keys: set[str]
    ) -> dict[str, int]:
        """One group's parameters behind its largest count; and those with no state in
        it (none taken) noted to read the group's `stored_keys` as zeros."""
        if not counts:
            return {}
        top = max(counts.values())
        lags = {}
        for name in named:
            lag = int(top - counts.get(name, 0))
            if lag > 0:
                lags[name] = lag
            if name not in counts:
                self._unstepped.setdefault(name, set()).update(stored_keys)
        return lags

    def _named(self, positions: list[Any], g: int) -> list[str]:
        """Group `g`'s parameter positions as the engine's parameter names: the i-th of
        the file's group is the i-th of the engine's (torch's rule)."""
        ours = self._order[g] if self._order is not None and g < len(self._order) else None
        if ours is None or len(ours) != len(positions):
            theirs = len(positions)
            mine = "no such group" if ours is None else f"{len(ours)} parameters"
            raise CheckpointError(
                f"{self.path}: the optimizer state is keyed by position, and its param group "
                f"{g} has {theirs} parameters where the engine's optimizer has {mine}. "
                "Build the optimizer with the same param groups, in the same order, to "
                "resume; or load the weights alone (load_optimizer_states=False)."
            )
        return list(ours)

    def client_state(self) -> dict[str, Any]:
        """What the file holds besides the model and optimizer (Lightning's loops,
        callbacks, epoch): the client state of a sharded checkpoint."""
        return {k: v for k, v in self.checkpoint.items() if k not in self._whole_keys}

    def _tensor(self, name: str, prefix: str) -> torch.Tensor:
        if not prefix:
            return self._weights[name]
        return self._state[name][prefix.removesuffix("/")]

    def holds(self, name: str, prefix: str) -> bool:
        if not prefix:
            return name in self._weights
        key = prefix.removesuffix("/")
        return key in self._state.get(name, {}) or key in self._unstepped.get(name, ())

    def _reads_zeros(self, name: str, prefix: str) -> bool:
        key = prefix.removesuffix("/")
        return key not in self._state.get(name, {}) and key in self._unstepped.get(name, ())

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
        """Elements [lo, hi) of `name` (or its `prefix` state) in the stored coordinates
        of `layout`: a tensor-parallel block is cut out of the whole tensor first."""
        if prefix and self._reads_zeros(name, prefix):  # no step taken: no state, zeros
            zeros = torch.zeros(hi - lo, dtype=dtype)
            return zeros if out is None else out.copy_(zeros)
        tensor, at = self._tensor(name, prefix), 0
        if layout is not None and layout.sharded:
            start, shape = layout.block(layout.position)
            tensor = tensor[tuple(slice(a, a + n) for a, n in zip(start, shape))]
            at = layout.offset
        values = tensor.reshape(-1)[lo - at : hi - at]
        if out is None:
            return values.to(dtype, copy=True)
        return out.copy_(values)

    def verify(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str = "",
        dtype: torch.dtype = torch.float32,
        layout: TensorPlacement | None = None,
    ) -> None:
        """The range exists (a torch file has no checksums to check it against)."""
        if not self.holds(name, prefix):
            raise CheckpointError(f"{self.path} holds no {prefix}{name}: {self._whole_hint}")
        if self.read(name, lo, hi, prefix, dtype=dtype, layout=layout).numel() != hi - lo:
            raise CheckpointError(f"{self.path}: {prefix}{name} is too short. {self._whole_hint}")

    _whole_hint = "the file is of another model, or truncated."

    def buffer(self, name: str) -> torch.Tensor:
        return self._weights[name]
