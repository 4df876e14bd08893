"""`state_dict_type="full"`: a checkpoint written as one torch file, as Lightning's and
Fabric's FSDP strategies write it, that `LightningModule.load_from_checkpoint`,
`torch.load(path, weights_only=True)` and a DDP run open like any other.

The engine writes its sharded checkpoint beside the target first (every rank its own
part), then rank 0 streams it into the one file (`checkpoint/consolidate.py`: the memory
peak is one tensor, never the model) and removes the sharded copy. The optimizer state is
kept whole, keyed by parameter name as FSDP's full optimizer state is, and loads back into
any world size and stage (`checkpoint/one_file.py`). The cost is disk: the sharded copy and
the file exist together for a moment; a disk without room for both is refused before the
file is begun, naming the sharded form.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zero_strategy.checkpoint.consolidate import consolidate
from zero_strategy.checkpoint.safe_load import CheckpointError

STATE_DICT_TYPES = ("sharded", "full")


def check_state_dict_type(value: str, entry: str) -> str:
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"{entry}(state_dict_type={value!r}): use 'sharded' (a directory of each rank's "
            "shards, the default) or 'full' (one file, written by rank 0)."
        )
    return value


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_whole(
    engine: Any,
    path: str | os.PathLike,
    client_state: dict[str, Any],
    agree: Callable[[str | None], str | None],
    keys: dict[str, Any] | None = None,
) -> None:
    """Write the engine's model and optimizer state, with `client_state`, to the one file
    `path` (collective). `agree` hands rank 0's outcome to every rank (the framework's
    broadcast). `keys`: where the model and optimizer state go (Fabric's names; Lightning's
    `state_dict` and `optimizer_states` by default)."""
    target = Path(path)
    staging = target.with_name(f".{target.name}.sharded")
    engine.save_checkpoint(staging, client_state=client_state)
    error = None
    if engine.rank == 0:
        try:
            needed, free = _bytes_under(staging), free_bytes(target.parent)
            if needed > free:
                raise CheckpointError(
                    f"the file needs about {needed / 2**20:.0f} MiB and the disk has "
                    f"{free / 2**20:.0f} MiB free beside the sharded copy it is written from. "
                    "Free some space, or save with state_dict_type='sharded' (no copy)."
                )
            partial = target.with_name(f".{target.name}.partial")
            consolidate(
                staging, partial, "lightning", with_optimizer=True, show_progress=False, keys=keys
            )
            os.replace(partial, target)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    error = agree(error)
    if error:
        raise CheckpointError(f"Writing the one-file checkpoint {target}: {error}")
