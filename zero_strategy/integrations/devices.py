"""Device placement shared by the framework adapters: the engine places (and shards) the
parameters; the adapters place the rest."""

from __future__ import annotations

import torch

from ..layout.fp32_params import Fp32Parameters, fp32_patterns
from .private_api import report_placement


def require_cpu_or_cuda(device: torch.device, entry: str) -> None:
    """The engine runs on gloo (CPU) and NCCL (CUDA) only; `entry` names where to fix it."""
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(
            f"zero-strategy runs on CPU (gloo) and CUDA (nccl), not on '{device.type}'. "
            f"Use {entry}(accelerator='cpu') or accelerator='cuda'."
        )


def place_buffers(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype | None = None,
    fp32_parameters: list[str] | None = None,
) -> None:
    """Move the buffers onto `device` (floating ones also to `dtype`, for a "-true"
    precision, as the framework's own precision plugin converts the module, except those
    kept in fp32 as their parameters are: `ZeroConfig.fp32_parameters`) and record it
    as the module's device (what `LightningModule.device` reports, and where `self.log`
    and Lightning's collectives put their tensors); parameters are placed by the engine,
    one unit at a time."""
    kept = Fp32Parameters(fp32_patterns(model, fp32_parameters, dtype))
    for path, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                continue
            target = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if kept and b.is_floating_point() and kept([f"{path}.{name}" if path else name]):
                target = torch.float32
            if b.device != device or b.dtype != target:
                setattr(module, name, b.to(device, target))  # keeps it persistent or not
        report_placement(module, device, dtype)  # Lightning's device/dtype mixin
