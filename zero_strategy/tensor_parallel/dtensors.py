"""A DTensor parameter as the engine handles it: its local shard (whose memory the
engine provides), its dtype, and its gradient as a plain local tensor.

`torch.distributed.tensor` is not imported here: it costs half a second of every
`import zero_strategy` (a torchrun job's, the consolidation command's), and no tensor can
be a DTensor before something has imported it. Every function below that needs its
classes is reached only through a DTensor, so the module is loaded by then.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
from torch import nn

from .. import private_api

_DTENSOR_MODULE = "torch.distributed.tensor"
# torch 2.13's dynamo cannot fake a DTensor whose local shard starts inside its storage;
# 2.14's can (`tests/test_compile.py` keeps the bare reproduction). Before, each shard
# gets a storage of its own (`on_storage_of_its_own`; at stage 3, a copy per gather).
SHARD_INSIDE_A_STORAGE_COMPILES = torch.torch_version.TorchVersion(torch.__version__) >= "2.14"


def _dtensors() -> ModuleType | None:
    """torch.distributed.tensor, if anything has imported it (a submodule's import loads
    it too); None otherwise."""
    return sys.modules.get(_DTENSOR_MODULE)


def is_dtensor(t: torch.Tensor) -> bool:
    module = _dtensors()
    return module is not None and isinstance(t, module.DTensor)


def is_shard(placement: object) -> bool:
    """A DTensor placement that splits a dimension (`Shard(d)`)."""
    module = _dtensors()
    return module is not None and isinstance(placement, module.Shard)


def is_replicate(placement: object) -> bool:
    module = _dtensors()
    return module is not None and isinstance(placement, module.Replicate)


def _from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor of `like`'s mesh, placements, shape and stride over `local`."""
    return _dtensors().DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The plain tensor a parameter's values live in on this rank: a DTensor's local
    shard (the same object for the DTensor's lifetime: the engine re-points its `.data`),
    the parameter itself otherwise."""
    return private_api.local_tensor(p) if is_dtensor(p) else p


def on_storage_of_its_own(values: torch.Tensor) -> torch.Tensor:
    """`values` (contiguous, inside a larger storage) over the same memory, as a tensor
    whose storage starts at its first element. torch 2.13's compile cannot trace a
    DTensor whose local shard starts inside its storage (dynamo's fake copy of the shard
    fails); a slice of the storage is memory shared, not copied. Only for memory that is
    never freed while the result lives (stages 0-2's persistent buffers): the slice keeps
    the old address when its parent storage is resized. Not needed from torch 2.14
    (`SHARD_INSIDE_A_STORAGE_COMPILES`, which its caller reads)."""
    if values.is_meta or values.storage_offset() == 0:
        return values
    storage = values.untyped_storage()
    start = values.storage_offset() * values.element_size()
    piece = storage[start : start + values.numel() * values.element_size()]
    return torch.empty(0, dtype=values.dtype, device=values.device).set_(
        piece, 0, values.shape, values.stride()
    )


def real_dtensor_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor of `p`'s mesh, placements and shape over `local` (a meta parameter's
    real replacement; its local shard is resized when the engine points it at memory)."""
    return _from_local(local, p)


def match_local_dtype(p: torch.Tensor) -> None:
    """A DTensor's dtype is fixed when it is made, but the engine gives its local shard
    the compute dtype (bf16 views of its buffers), or back the masters' (release): wrap
    the local shard again, in place, so that the parameter, its gradients and its
    state_dict() carry the dtype it computes in."""
    if is_dtensor(p) and p.dtype != local_tensor(p).dtype:
        again = nn.Parameter(real_dtensor_like(p, local_tensor(p)), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, again)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a plain tensor of its local shape. A DTensor gradient
    with another placement than its parameter (a replicated weight used on sequence
    shards has a Partial one) is first brought to the parameter's (a collective over the
    tensor group)."""
    grad = p.grad
    if grad is None or not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
        p.grad = grad
    return private_api.local_tensor(grad)


def set_local_grad(p: torch.Tensor, local: torch.Tensor | None) -> None:
    """Point a parameter's `.grad` at `local` (a view of the engine's buffer): as a
    DTensor of the parameter's placement for a DTensor parameter, so that autograd keeps
    accumulating into the same memory."""
    if local is None or not is_dtensor(p):
        p.grad = local
        return
    p.grad = _from_local(local, p)
