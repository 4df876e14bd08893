"""Build models bigger than one rank: construct on the `meta` device, then materialize one
unit at a time and keep only this rank's shard.

    with zero_strategy.init_on_meta():
        model = GPT(cfg)                      # no memory allocated
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3))   # each rank holds 1/N

Values come from the model's own initialisation: `param_init_fn(module)` if given, else
the root's `_init_weights(module)` (Hugging Face models), else `module.reset_parameters()`.
Rank 0's values are broadcast, so every rank starts from the same model whatever its RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .partition import ParamSlot

InitFn = Callable[[nn.Module], None]


@contextlib.contextmanager
def init_on_meta() -> Iterator[None]:
    """Construct modules without allocating their parameters."""
    with torch.device("meta"):
        yield


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def detach_from_meta(params: list[nn.Parameter], device: torch.device) -> None:
    """Turn meta parameters into empty real ones in place (object identity is kept, so the
    optimizer's references and the module's registrations stay valid)."""
    for p in params:
        if p.is_meta:
            real = nn.Parameter(
                torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad
            )
            torch.utils.swap_tensors(p, real)


def owner_modules(model: nn.Module, slots: list[ParamSlot]) -> list[tuple[str, nn.Module]]:
    paths: dict[str, None] = {}
    for slot in slots:
        for name in (slot.name, *slot.aliases):
            paths[name.rsplit(".", 1)[0] if "." in name else ""] = None
    return [(path, model.get_submodule(path)) for path in paths]


def run_init(
    model: nn.Module, modules: list[tuple[str, nn.Module]], init_fn: InitFn | None
) -> None:
    """Initialise the parameters directly owned by each module (now real, pointing at a
    flat buffer). A module under an ancestor with `zero_initialise()` (MoE experts, which
    seed each expert by its global id) is left to that ancestor, called once."""
    hf_init = getattr(model, "_init_weights", None)
    owners = {
        path: module
        for path, module in model.named_modules()
        if callable(getattr(module, "zero_initialise", None))
    }
    done: set[str] = set()
    for path, module in modules:
        owner = next((o for o in owners if path == o or path.startswith(o + ".") or o == ""), None)
        if owner is not None:
            if owner not in done:
                owners[owner].zero_initialise()
                done.add(owner)
            continue
        if init_fn is not None:
            init_fn(module)
        elif callable(hf_init):
            hf_init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"Module '{path or '<root>'}' ({type(module).__name__}) was built on the meta "
                "device and has no reset_parameters(), so its initial values are unknown. Pass "
                "param_init_fn=fn to ZeroEngine, where fn(module) initialises the parameters "
                "a module owns directly."
            )


def detach_meta_buffers(
    model: nn.Module, device: torch.device, init_fn: InitFn | None
) -> list[tuple[str, nn.Module]]:
    """Where the model's initialisation can recompute buffers (`init_fn`, or a Hugging
    Face model's `_init_weights`, which fills rotary frequencies and norm statistics),
    make its meta buffers real (empty) ones; returns the modules owning them that own no
    parameter, for `run_init` after the parameters (owners of both are initialised with
    their parameters)."""
    if init_fn is None and not callable(getattr(model, "_init_weights", None)):
        return []
    owners = []
    for path, module in model.named_modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for name in meta:
            setattr(module, name, torch.empty_like(getattr(module, name), device=device))
        if meta and next(module.parameters(recurse=False), None) is None:
            owners.append((path, module))
    return owners


def check_no_meta_buffers(model: nn.Module) -> None:
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(
            f"Buffers {meta[:5]} are still on the meta device: buffers are not sharded and "
            "cannot be recomputed after construction. Create them on the real device (e.g. "
            "register them after the meta context) or recreate them in param_init_fn."
        )
