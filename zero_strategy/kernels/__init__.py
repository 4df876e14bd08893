"""Fused kernels: Triton on CUDA, with a plain-torch reference of the same signature.

- `fused_adamw_`: Adam/AdamW over many shards in one launch, with gradient scale, skip on
  overflow and the compute-copy write-back folded in.
- `multi_tensor_l2_norm` / `multi_tensor_sum_squares`: the global gradient norm and an
  inf/nan flag in one pass.
- MoE routing: `topk_route`, `plan_dispatch`, `permute`, `unpermute`.

`use_backend("triton" | "reference" | "auto")` (or ZERO_STRATEGY_KERNELS) picks the path.
"""

from .adamw import fused_adamw_, reference_adamw_
from .backend import selected_backend, triton_importable, use_backend, use_triton
from .moe_routing import DispatchPlan, permute, plan_dispatch, topk_route, unpermute
from .norm import (
    multi_tensor_l2_norm,
    multi_tensor_sum_squares,
    non_finite_flag,
    reference_sum_squares,
)

__all__ = [
    "DispatchPlan",
    "fused_adamw_",
    "multi_tensor_l2_norm",
    "multi_tensor_sum_squares",
    "non_finite_flag",
    "permute",
    "plan_dispatch",
    "reference_adamw_",
    "reference_sum_squares",
    "selected_backend",
    "topk_route",
    "triton_importable",
    "unpermute",
    "use_backend",
    "use_triton",
]
