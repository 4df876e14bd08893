"""Which implementation a kernel call runs: Triton or the plain-torch reference.

``auto`` (the default) runs Triton on CUDA tensors when Triton imports, the reference
everywhere else. ``triton`` forces the Triton path, also on CPU tensors, which works only
under the Triton interpreter (``TRITON_INTERPRET=1``, how the tests exercise the kernels on
machines without a GPU). ``reference`` forces plain torch. Choose with the
``ZERO_STRATEGY_KERNELS`` environment variable or, in code, with ``use_backend(...)``.

Triton reads ``TRITON_INTERPRET`` when each jit function is defined, its own library's
included, so the variable must be set before triton is first imported; the kernel modules
are imported on first use, never at package import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "reference")
_override: list[str] = []


@functools.cache
def triton_importable() -> bool:
    """Whether `import triton` would succeed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def selected_backend() -> str:
    choice = _override[-1] if _override else os.environ.get("ZERO_STRATEGY_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(
            f"ZERO_STRATEGY_KERNELS={choice!r} is not a kernel backend; use one of {BACKENDS}."
        )
    return choice


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the kernels inside the block with `name` ('auto', 'triton' or 'reference')."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown kernel backend {name!r}; use one of {BACKENDS}.")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a call on `tensors` should run its Triton implementation."""
    choice = selected_backend()
    if choice == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if choice == "auto":
        return on_cuda and triton_importable() and not interpreting()
    if not triton_importable():
        raise RuntimeError(
            "The 'triton' kernel backend was requested but Triton is not installed; "
            "`pip install triton` or choose the 'reference' backend."
        )
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "The 'triton' kernel backend on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported, or use "
            "CUDA tensors."
        )
    return True


def _first_device(args) -> torch.device | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0].device
    return None


def on_tensor_device(launch):
    """Triton launches on the current CUDA device, not on the tensors' device: a process
    that placed its model on cuda:1 without `torch.cuda.set_device` would launch on
    cuda:0. Enter the device of the first tensor argument for the launch."""

    @functools.wraps(launch)
    def wrapper(*args, **kwargs):
        device = _first_device(args)
        if device is None or device.type != "cuda":
            return launch(*args, **kwargs)
        with torch.cuda.device(device):
            return launch(*args, **kwargs)

    return wrapper
