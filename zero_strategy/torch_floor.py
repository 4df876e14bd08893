"""The oldest torch this package runs on, checked when it is imported.

The engine calls torch.distributed's `all_gather_single` and `reduce_scatter_single`, the
names torch 2.13 gave to `all_gather_into_tensor` / `reduce_scatter_tensor` (deprecating
the old ones). On an older torch the first collective would fail deep inside a training
step; failing at import names the fix instead.
"""

from __future__ import annotations

import torch

MIN_TORCH = "2.13"


def check(version: str = torch.__version__) -> None:
    if torch.torch_version.TorchVersion(version) < MIN_TORCH:
        raise ImportError(
            f"zero-strategy needs torch>={MIN_TORCH} (for torch.distributed.all_gather_single "
            f"and reduce_scatter_single), but torch {version} is installed. Upgrade it: "
            f"pip install 'torch>={MIN_TORCH}'."
        )


check()
