"""Fused Adam/AdamW over many tensors, with torch.optim's exact update rule.

``fused_adamw_`` updates fp32 params and their exp_avg/exp_avg_sq in place. Beyond
torch's fused AdamW it folds in what a ZeRO step needs in the same pass: the gradient
scale (inverse loss scale times the clipping coefficient), a skip flag for fp16 overflow
(read on the device: no host sync), and the write-back of the bf16/fp16 compute copy.

The reference below is the same computation in plain torch (foreach ops); the Triton
path runs on CUDA (see backend.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import use_triton


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: torch.Tensor,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    maximize: bool = False,
    grad_scale: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    compute_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """One Adam (``adamw=False``: L2 penalty in the gradient) or AdamW step.

    step: float32 scalar tensor on the params' device, the number of steps taken so far;
        incremented in place unless ``found_inf`` is set.
    grad_scale: multiplies every gradient first (e.g. ``1 / loss_scale * clip_coef``).
    found_inf: float32 scalar tensor; nonzero skips the whole update (params, states and
        step keep their values).
    compute_copies: low-precision tensors, one per param, that receive the new values.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, compute_copies)
    if not params:
        return
    beta1, beta2 = betas
    device = params[0].device
    skip = found_inf if found_inf is not None else torch.zeros((), device=device)
    step.add_(1.0 - (skip != 0).to(step.dtype))
    # Bias corrections in float64 on the device, then rounded once, as torch computes
    # them in Python doubles.
    count = step.to(torch.float64).clamp(min=1.0)
    bias_correction1 = 1.0 - torch.pow(beta1, count)
    bias_correction2 = 1.0 - torch.pow(beta2, count)
    if isinstance(grad_scale, torch.Tensor):
        scale = grad_scale.to(device=device, dtype=torch.float64).reshape(())
    else:
        value = 1.0 if grad_scale is None else float(grad_scale)
        scale = torch.tensor(value, dtype=torch.float64, device=device)
    coeffs = torch.stack(
        [lr / bias_correction1, bias_correction2.sqrt(), scale, (skip != 0).to(torch.float64)]
    ).to(torch.float32)
    # Scalars combined in double precision on the host, then rounded once, as torch does.
    hyper = dict(
        decay=1.0 - lr * weight_decay,
        weight_decay=weight_decay,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        eps=eps,
        adamw=adamw,
        maximize=maximize,
    )
    if use_triton(*params):
        from . import adamw_triton

        for idx in _launch_groups(grads, compute_copies):
            adamw_triton.launch(
                [params[i] for i in idx],
                [grads[i] for i in idx],
                [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx],
                [compute_copies[i] for i in idx] if compute_copies is not None else None,
                coeffs,
                **hyper,
            )
    else:
        reference_adamw_(params, grads, exp_avgs, exp_avg_sqs, compute_copies, coeffs, **hyper)


def reference_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    compute_copies: Sequence[torch.Tensor] | None,
    coeffs: torch.Tensor,
    *,
    decay: float,
    weight_decay: float,
    beta2: float,
    one_minus_beta1: float,
    one_minus_beta2: float,
    eps: float,
    adamw: bool,
    maximize: bool,
) -> None:
    """Plain-torch twin of the Triton kernel (same arguments, same operation order)."""
    step_size, bc2_sqrt, scale, skip = coeffs.unbind()
    live = skip == 0
    for p, g, m, v, i in zip(params, grads, exp_avgs, exp_avg_sqs, range(len(params))):
        g = g.to(torch.float32) * scale
        if maximize:
            g = -g
        new_p = p * decay if adamw else p
        if not adamw and weight_decay:
            g = g + weight_decay * p
        new_m = m + one_minus_beta1 * (g - m)
        new_v = v * beta2 + one_minus_beta2 * g * g
        new_p = new_p - step_size * (new_m / (new_v.sqrt() / bc2_sqrt + eps))
        p.copy_(torch.where(live, new_p, p))
        m.copy_(torch.where(live, new_m, m))
        v.copy_(torch.where(live, new_v, v))
        if compute_copies is not None:
            compute_copies[i].copy_(p)


def _launch_groups(
    grads: Sequence[torch.Tensor], copies: Sequence[torch.Tensor] | None
) -> list[list[int]]:
    """Indices of tensors that can share one launch (same grad and copy dtypes)."""
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        key = (g.dtype, copies[i].dtype if copies is not None else None)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _check(params, grads, exp_avgs, exp_avg_sqs, copies) -> None:
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if copies is not None:
        lists["compute_copies"] = copies
    for name, ts in lists.items():
        if len(ts) != n:
            raise ValueError(f"fused_adamw_: {len(ts)} {name} for {n} params; pass one each.")
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            raise TypeError(f"fused_adamw_: param {i} is {p.dtype}; the master must be float32.")
        for name, ts in lists.items():
            t = ts[i]
            if t.numel() != p.numel() or t.device != p.device:
                raise ValueError(
                    f"fused_adamw_: {name}[{i}] has {t.numel()} elements on {t.device}, "
                    f"param {i} has {p.numel()} on {p.device}."
                )
            if not t.is_contiguous():
                raise ValueError(f"fused_adamw_: {name}[{i}] must be contiguous.")
        if not p.is_contiguous():
            raise ValueError(f"fused_adamw_: param {i} must be contiguous.")
        for name in ("exp_avgs", "exp_avg_sqs"):
            if lists[name][i].dtype != torch.float32:
                raise TypeError(f"fused_adamw_: {name}[{i}] must be float32.")
