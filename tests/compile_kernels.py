"""Compile every Triton kernel for real NVIDIA targets, without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler: type errors, unsupported
ops and layout problems only appear when the kernel is lowered to PTX and assembled.
Triton can do that on any machine (it ships ptxas), so this script compiles each kernel,
in each variant its launcher uses, for Hopper (sm_90) and Ampere (sm_80). Run by
tests/test_kernels_compile.py in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from zero_strategy.kernels import adamw_triton, moe_triton, norm_triton

ADAM_ARGS = dict(
    addresses="*i64",
    numels="*i64",
    chunks="*i64",
    n_tensors="i32",
    n_chunks="i32",
    coeffs="*fp32",
    decay="fp32",
    weight_decay="fp32",
    beta2="fp32",
    one_minus_beta1="fp32",
    one_minus_beta2="fp32",
    eps="fp32",
)


def variants():
    chunk = dict(CHUNK=16 * 1024, BLOCK=1024)
    for grad in (tl.float32, tl.bfloat16, tl.float16):
        for copy, write in ((tl.float32, False), (tl.bfloat16, True), (tl.float16, True)):
            for adamw, maximize in ((True, False), (False, True)):
                yield (
                    adamw_triton._adam_chunk_kernel,
                    ADAM_ARGS,
                    dict(
                        GRAD_DTYPE=grad,
                        COPY_DTYPE=copy,
                        ADAMW=adamw,
                        MAXIMIZE=maximize,
                        WRITE_COPY=write,
                        **chunk,
                    ),
                )
    for dtype in (tl.float32, tl.bfloat16, tl.float16):
        yield (
            norm_triton._sum_squares_kernel,
            dict(addresses="*i64", numels="*i64", chunks="*i64", n_chunks="i32", partials="*fp32"),
            dict(DTYPE=dtype, **chunk),
        )
    for logits in ("*fp32", "*bf16"):
        for k, normalize in ((1, False), (2, True), (8, True)):
            yield (
                moe_triton._topk_softmax_kernel,
                dict(logits=logits, weights_out="*fp32", index_out="*i64", E="i32"),
                dict(K=k, NORMALIZE=normalize, BLOCK_E=128),
            )
    yield (
        moe_triton._expert_positions_kernel,
        dict(expert_index="*i64", position_out="*i64", counts_out="*i64", T="i32"),
        dict(K=2, BLOCK=1024),
    )
    for data in ("*fp32", "*bf16"):
        for weighted in (False, True):
            rows = dict(rows="*i64", weights="*fp32" if weighted else "*i64", H="i32")
            yield (
                moe_triton._scatter_rows_kernel,
                dict(x=data, out=data, **rows),
                dict(K=2, HAS_WEIGHTS=weighted, BLOCK_H=1024),
            )
            yield (
                moe_triton._gather_rows_kernel,
                dict(y=data, out=data, **rows),
                dict(K=2, HAS_WEIGHTS=weighted, BLOCK_H=1024),
            )
        yield (
            moe_triton._row_dot_kernel,
            dict(grad=data, y=data, rows="*i64", out="*fp32", H="i32"),
            dict(K=2, BLOCK_H=1024),
        )


def compile_one(fn, args: dict, constexprs: dict, target: GPUTarget) -> None:
    # The signature follows the kernel's own argument order.
    types = {**args, **dict.fromkeys(constexprs, "constexpr")}
    signature = {name: types[name] for name in fn.arg_names}
    positions = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=positions), target=target)


def main() -> int:
    failures = 0
    count = 0
    for arch in (90, 80):
        target = GPUTarget("cuda", arch, 32)
        for fn, args, constexprs in variants():
            count += 1
            try:
                compile_one(fn, args, constexprs, target)
            except Exception as e:  # report every failing variant, not just the first
                failures += 1
                print(f"FAILED sm_{arch} {fn.fn.__name__} {constexprs}: {e!r}"[:2000])
    print(f"compiled {count - failures} of {count} kernel variants")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
