"""Which node each global rank runs on, for `comm_report()`'s within/across-node split.

Launchers lay ranks out node by node: torchrun (and Lightning and SLURM after it) gives
node k the global ranks [k * L, (k + 1) * L) for L ranks per node, and torchrun exports L
as `LOCAL_WORLD_SIZE`. Without it every rank counts as one node's: one machine, or a
launcher that does not say.
"""

from __future__ import annotations

import os


def ranks_per_node() -> int | None:
    """L, the ranks of one node, from the launcher's `LOCAL_WORLD_SIZE` (None: unknown)."""
    try:
        value = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def nodes_of(global_ranks: tuple[int, ...], per_node: int | None) -> list[int]:
    """The node of each of `global_ranks`."""
    return [0 if per_node is None else rank // per_node for rank in global_ranks]
