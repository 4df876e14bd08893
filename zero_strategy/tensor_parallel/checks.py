"""What tensor parallelism beside the engine refuses, naming the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dtensors import is_dtensor, is_replicate, is_shard
from .mesh import MeshLayout


def check_parameters(named: Sequence[tuple[str, torch.Tensor]], layout: MeshLayout) -> None:
    """DTensor parameters must be tensor-parallel over this rank's tensor group of the
    engine's mesh, and a model with any needs a mesh: refuse anything else, naming it."""
    dtensors = [(n, p) for n, p in named if is_dtensor(p)]
    if not dtensors:
        return
    name, p = dtensors[0]
    if layout.tensor_size == 1:
        ranks = p.device_mesh.mesh.flatten().tolist()
        raise ValueError(
            f"Parameter {name!r} is a DTensor (tensor parallel over ranks {ranks}), but the "
            "engine was given no tensor-parallel mesh. Pass device_mesh=<the 2-D (data, "
            "tensor) mesh the plan was applied on>, or tensor_parallel_size="
            f"{len(ranks)}."
        )
    for name, p in dtensors:
        mesh = p.device_mesh
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        if ranks != layout.tensor_group:  # (a mesh of several dimensions, flattened)
            raise ValueError(
                f"Parameter {name!r} is a DTensor on a mesh of ranks "
                f"{mesh.mesh.tolist()}, but this rank's tensor-parallel group is "
                f"{list(layout.tensor_group)}. Apply the tensor-parallel plan on the mesh's "
                "'tensor' dimension (device_mesh['tensor']); a model already sharded by "
                "fully_shard cannot be sharded again."
            )
        if any(not (is_shard(x) or is_replicate(x)) for x in p.placements):
            raise ValueError(
                f"Parameter {name!r} has placements {p.placements}; a parameter is either "
                "sharded (Shard) or replicated (Replicate) over the tensor dimension."
            )


HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


def check_head_counts(named: Sequence[tuple[str, torch.Tensor]], config, tensor_size: int) -> None:
    """A plan that shards attention splits its heads: each rank must get whole ones. The
    model's (Hugging Face style) config says how many there are."""
    attention_sharded = any(
        ("attn" in name or "attention" in name)
        and is_dtensor(p)
        and any(is_shard(x) for x in p.placements)
        for name, p in named
    )
    if not attention_sharded or config is None:
        return
    for attr in HEAD_COUNTS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and not isinstance(count, bool) and count % tensor_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(
                f"The model's config.{attr}={count} is not divisible by "
                f"tensor_parallel_size={tensor_size}: the plan would split a head across "
                f"ranks. Use a tensor_parallel_size that divides {count} (one of "
                f"{divisors}), or keep attention out of the plan."
            )
