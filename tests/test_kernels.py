"""Every Triton kernel against its plain-torch reference.

On a machine without a GPU the kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set by conftest.py before triton is imported) on CPU tensors; with a GPU
they run compiled on CUDA (benchmarks/gpu_check.py runs this file there).
"""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()  # without one, conftest.py set TRITON_INTERPRET=1

pytest.importorskip("triton", reason="Triton is not installed: the kernels cannot be tested")

from zero_strategy.kernels import (  # noqa: E402
    fused_adamw_,
    multi_tensor_l2_norm,
    permute,
    plan_dispatch,
    topk_route,
    unpermute,
    use_backend,
)
from zero_strategy.kernels.moe_routing import (  # noqa: E402
    reference_permute,
    reference_topk_route,
    reference_unpermute,
)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter casts fp32 to bf16 by truncation (GPUs round to nearest even), so the
# low-precision write-back is checked in fp16 there and in bf16 on a GPU.
COPY_DTYPE = torch.bfloat16 if ON_GPU else torch.float16
# Shard sizes that hit every edge: one element, odd sizes, a block boundary, just past it,
# and (on the chunk table) more than one chunk per tensor.
RAGGED = [1, 7, 1023, 1024, 1025, 3000, 70_001]


def _shards(sizes, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale).to(DEVICE) for n in sizes]


# ----------------------------------------------------------------------------- AdamW
@pytest.mark.parametrize(
    "adamw, weight_decay, maximize",
    [(True, 0.1, False), (False, 0.05, False), (True, 0.0, True)],
)
def test_fused_adamw_matches_torch_over_many_steps(adamw, weight_decay, maximize):
    steps, lr, betas, eps = 12, 3e-3, (0.9, 0.95), 1e-8
    params = _shards(RAGGED, 0)
    ref_params = [torch.nn.Parameter(p.clone()) for p in params]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls(
        ref_params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=False,
    )
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = torch.zeros((), device=DEVICE)
    for i in range(steps):
        grads = _shards(RAGGED, 100 + i)
        for rp, g in zip(ref_params, grads):
            rp.grad = g.clone()
        ref.step()
        with use_backend("triton"):
            fused_adamw_(
                params,
                grads,
                m,
                v,
                step=step,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                adamw=adamw,
                maximize=maximize,
            )
    assert step.item() == steps
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p, rp.detach(), rtol=2e-6, atol=2e-7)
    for mine, rp in zip(m, ref_params):
        torch.testing.assert_close(mine, ref.state[rp]["exp_avg"], rtol=2e-6, atol=1e-7)


def test_fused_adamw_scale_skip_and_compute_copy_match_reference():
    """Gradient scale, the device-side skip flag and the compute-copy write-back, Triton
    against the reference, with no host read of the flag."""
    sizes = [5, 1500, 2049]
    results = {}
    for backend in ("triton", "reference"):
        params = _shards(sizes, 1)
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        copies = [torch.empty(n, dtype=COPY_DTYPE, device=DEVICE) for n in sizes]
        step = torch.zeros((), device=DEVICE)
        with use_backend(backend):
            for i, skip in enumerate([0.0, 1.0, 0.0]):
                found_inf = torch.tensor(skip, device=DEVICE)
                grads = _shards(sizes, 10 + i, scale=1024.0)
                fused_adamw_(
                    params,
                    grads,
                    m,
                    v,
                    step=step,
                    lr=1e-2,
                    weight_decay=0.01,
                    grad_scale=torch.tensor(1 / 1024, device=DEVICE),
                    found_inf=found_inf,
                    compute_copies=copies,
                )
                if skip:
                    before = [p.clone() for p in params]
                    fused_adamw_(params, grads, m, v, step=step, lr=1e-2, found_inf=found_inf)
                    assert all(torch.equal(a, b) for a, b in zip(before, params))
        assert step.item() == 2
        for p, c in zip(params, copies):
            assert torch.equal(c, p.to(COPY_DTYPE))
        results[backend] = params
    for a, b in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adamw_rejects_mismatched_lists():
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="2 grads for 1 params"):
        fused_adamw_(p, [torch.zeros(3)] * 2, p, p, step=torch.zeros(()), lr=1e-3)
    with pytest.raises(TypeError, match="master must be float32"):
        h = [torch.zeros(3, dtype=torch.float16)]
        fused_adamw_(h, h, h, h, step=torch.zeros(()), lr=1e-3)


# ----------------------------------------------------------------------------- norm
def test_multi_tensor_norm_matches_reference_and_flags_non_finite():
    shards = _shards(RAGGED, 3)
    expected = torch.linalg.vector_norm(torch.cat([s.double() for s in shards]))
    with use_backend("triton"):
        norm, found_inf = multi_tensor_l2_norm(shards)
    assert found_inf.item() == 0.0
    torch.testing.assert_close(norm.double(), expected, rtol=1e-6, atol=0)
    for bad in (float("inf"), float("nan")):
        broken = [s.clone() for s in shards]
        broken[4][17] = bad
        with use_backend("triton"):
            _, found_inf = multi_tensor_l2_norm(broken)
        assert found_inf.item() == 1.0


# ----------------------------------------------------------------------------- routing
def _logits(tokens, experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g).to(DEVICE)


@pytest.mark.parametrize("k, normalize", [(1, False), (2, True), (3, True)])
def test_topk_route_matches_reference_including_ties(k, normalize):
    logits = _logits(37, 6, 0)
    logits[0] = 0.0  # all six experts tie: the lowest ids win
    logits[1, :4] = 1.5  # a four-way tie at the top
    logits[2] = torch.tensor([0.0, 2.0, 2.0, -1.0, 2.0, 0.0])
    with use_backend("triton"):
        weights, index = topk_route(logits, k, normalize)
    ref_w, ref_i = reference_topk_route(logits, k, normalize)
    assert torch.equal(index, ref_i)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    assert index[0].tolist() == list(range(k))
    assert index[2].tolist() == [1, 2, 4][:k]


@pytest.mark.parametrize("capacity", [None, 0, 3, 100])
def test_plan_dispatch_positions_and_zero_token_experts(capacity):
    """Expert 5 of 7 gets no token; positions follow first-choice-first priority."""
    g = torch.Generator().manual_seed(4)
    index = torch.randint(0, 5, (41, 2), generator=g)
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], 6, index[:, 1])
    index = index.to(DEVICE)
    with use_backend("triton"):
        plan = plan_dispatch(index, 7, capacity)
    with use_backend("reference"):
        ref = plan_dispatch(index, 7, capacity)
    for field in ("position", "tokens_per_expert", "kept_per_expert", "rows"):
        assert torch.equal(getattr(plan, field), getattr(ref, field)), field
    assert plan.tokens_per_expert[5] == 0 and plan.kept_per_expert.sum() == (plan.rows >= 0).sum()
    # Priority: a first choice of expert e is placed before any second choice of e.
    for e in range(7):
        first = plan.position[:, 0][index[:, 0] == e]
        second = plan.position[:, 1][index[:, 1] == e]
        assert first.tolist() == list(range(len(first)))
        assert second.tolist() == list(range(len(first), len(first) + len(second)))


@pytest.mark.parametrize("capacity", [None, 4])
def test_permute_unpermute_forward_and_backward_match_reference(capacity):
    tokens, experts, k, hidden = 23, 5, 2, 40
    weights, index = reference_topk_route(_logits(tokens, experts, 7), k)
    index[:, 0] = torch.where(index[:, 0] == 3, 0, index[:, 0])  # expert 3: fewer tokens
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], 3, index[:, 1])
    plan = plan_dispatch(index, experts, capacity)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    expert_w = torch.randn(plan.num_rows, hidden).to(DEVICE)  # stands in for the experts

    def run(fn_permute, fn_unpermute):
        xi = x.clone().requires_grad_()
        wi = weights.clone().requires_grad_()
        y = fn_permute(xi) * expert_w
        out = fn_unpermute(y, wi)
        (out * torch.arange(hidden, device=DEVICE)).sum().backward()
        return y.detach(), out.detach(), xi.grad, wi.grad

    with use_backend("triton"):
        got = run(lambda xi: permute(xi, plan), lambda y, wi: unpermute(y, plan, wi))
    want = run(
        lambda xi: reference_permute(xi, plan.rows, plan.num_rows),
        lambda y, wi: reference_unpermute(y, plan.rows, wi),
    )
    for a, b, name in zip(got, want, ("permuted", "combined", "grad x", "grad weights")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    if capacity is not None:
        dropped = plan.rows < 0
        assert dropped.any()  # the test covers dropped assignments
