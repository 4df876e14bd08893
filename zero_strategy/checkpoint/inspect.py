"""A readable summary of a checkpoint directory, from its index and file headers only."""

from __future__ import annotations

import math
import os
from collections import defaultdict

from safetensors import safe_open

from ..layout.partition import FROZEN_GROUP
from .format import located, read_index
from .safe_load import CheckpointError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summary(path: str | os.PathLike) -> str:
    path = located(path)  # the previous checkpoint when a save was killed mid-publish
    index = read_index(path)  # raises, naming what is missing, if incomplete
    params = index["params"]
    n_params = sum(math.prod(p["shape"]) for p in params.values())
    n_frozen = sum(math.prod(p["shape"]) for p in params.values() if p["group"] == FROZEN_GROUP)
    by_kind: dict[str, int] = defaultdict(int)
    problems = []
    for f in index["files"]:
        try:
            with safe_open(str(path / f), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    kind = key.split("/", 1)[0] if "/" in key else "parameters (fp32)"
                    sl = handle.get_slice(key)
                    by_kind[kind] += math.prod(sl.get_shape()) * (
                        2 if sl.get_dtype() in ("BF16", "F16") else 4
                    )
        except Exception as e:  # a truncated file: report it, keep summarising
            problems.append(f"{f}: unreadable ({e})")
    lines = [
        f"checkpoint   {path}",
        f"format       {index['format']}",
        f"world size   {index['world_size']}   stage {index['stage']}   step {index['step']}",
        f"parameters   {n_params:,} in {len(params)} tensors ({n_frozen:,} frozen)",
        f"optimizer    {index['optimizer']['class']}, {len(index['optimizer']['param_groups'])} "
        f"group(s), state {index['optimizer']['elementwise_state']}",
        "bytes by kind:",
        *(f"  {kind:<20} {_mib(n)}" for kind, n in sorted(by_kind.items())),
        f"complete     {'yes' if not problems else 'NO'} ({len(index['files'])} rank files)",
        *(f"  {p}" for p in problems),
    ]
    if problems:
        raise CheckpointError("\n".join(lines))
    return "\n".join(lines)
