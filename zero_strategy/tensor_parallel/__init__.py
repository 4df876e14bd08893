"""Tensor parallelism beside ZeRO: a 2-D (data x tensor) mesh of ranks.

Tensor parallelism itself is torch's (`torch.distributed.tensor.parallel`): the user's
plan turns some parameters into DTensors, each rank holding its shard along the mesh's
tensor dimension. The engine then runs ZeRO over the data dimension alone, on each
parameter's *local* tensor: the ranks at one tensor-parallel position form a
data-parallel world of their own and shard, reduce and gather exactly as without tensor
parallelism. Only what spans positions crosses the tensor dimension: the gradient norm
(tensor-sharded parameters counted at every position, replicated ones once), agreement on
a skipped step, and checkpoints.

The package holds what the engine needs to know about that, a concern per module:
`mesh` (the ranks' grid), `dtensors` (a DTensor parameter's local shard, dtype and
gradient), `blocks` (where a shard sits in its full tensor: checkpoints, whole
tensors), `checks` (what is refused) and `init` (meta-device initialisation).
"""

from __future__ import annotations

from .blocks import (
    TensorPlacement,
    broadcast_whole_parameters,
    full_tensor,
    placement_of,
    read_block,
)
from .checks import check_head_counts, check_parameters
from .dtensors import (
    SHARD_INSIDE_A_STORAGE_COMPILES,
    is_dtensor,
    local_grad,
    local_tensor,
    match_local_dtype,
    on_storage_of_its_own,
    real_dtensor_like,
    set_local_grad,
)
from .init import whole_for_init
from .mesh import MeshLayout, tensor_parallel_mesh

__all__ = [
    "SHARD_INSIDE_A_STORAGE_COMPILES",
    "MeshLayout",
    "TensorPlacement",
    "broadcast_whole_parameters",
    "check_head_counts",
    "check_parameters",
    "full_tensor",
    "is_dtensor",
    "local_grad",
    "local_tensor",
    "match_local_dtype",
    "on_storage_of_its_own",
    "placement_of",
    "read_block",
    "real_dtensor_like",
    "set_local_grad",
    "tensor_parallel_mesh",
    "whole_for_init",
]
