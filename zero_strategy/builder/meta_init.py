"""Build models bigger than one rank: construct on the `meta` device, then materialize one
unit at a time and keep only this rank's shard.

    with zero_strategy.init_on_meta():
        model = GPT(cfg)                      # no memory allocated
    engine = ZeroEngine(model, opt, ZeroConfig(stage=3))   # each rank holds 1/N

Values come from the model's own initialisation: `param_init_fn(module)` if given, else
the `_init_weights(module)` of the Hugging Face model holding it, else `module.reset_parameters()`.
Rank 0's values are broadcast, so every rank starts from the same model whatever its RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ..layout.partition import ParamSlot
from ..layout.shard_spec import within
from ..private_api import hf_init_weights
from ..tensor_parallel import is_dtensor, real_dtensor_like

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
    optimizer's references and the module's registrations stay valid). A tensor-parallel
    (DTensor) one becomes a DTensor of the same placement over an empty real local
    shard; the engine gives that shard its memory."""
    for p in params:
        if not p.is_meta:
            continue
        empty = torch.empty(0, dtype=p.dtype, device=device)
        if is_dtensor(p):
            empty = real_dtensor_like(p, empty)
        real = nn.Parameter(empty, requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, real)


def owner_modules(model: nn.Module, slots: list[ParamSlot]) -> list[tuple[str, nn.Module]]:
    paths: dict[str, None] = {}
    for slot in slots:
        for name in (slot.name, *slot.aliases):
            paths[name.rsplit(".", 1)[0] if "." in name else ""] = None
    return [(path, model.get_submodule(path)) for path in paths]


def run_init(
    model: nn.Module,
    modules: list[tuple[str, nn.Module]],
    init_fn: InitFn | None,
    keep: set[str] | None = None,
) -> None:
    """Initialise the parameters directly owned by each module (now real, pointing at a
    flat buffer). A module under an ancestor with `zero_initialise()` (MoE experts, which
    seed each expert by its global id) is left to that ancestor, called once. With `keep`
    (parameter names), every other parameter below each module is set aside while its
    initialiser runs (`parameters_aside`): an empty set for the buffers' initialisers,
    one unit's names when units are made one at a time."""
    # Hugging Face models initialise any of their modules (`_init_weights`): the deepest
    # such model holding a module does (the root, or one inside a LightningModule).
    hf_inits = {path: hf_init_weights(m) for path, m in model.named_modules() if hf_init_weights(m)}
    owners = {
        path: module
        for path, module in model.named_modules()
        if callable(getattr(module, "zero_initialise", None))
    }
    adapters = adapter_layers(model)
    done: set[str] = set()
    for path, module in modules:
        owner = next((o for o in owners if within(path, o)), None)
        if owner is not None:
            if owner not in done:
                owners[owner].zero_initialise()
                done.add(owner)
            continue
        layer = next((a for a in adapters if within(path, a) and not _in_base(path, a)), None)
        if layer is not None:
            if layer not in done:  # PEFT's own init: LoRA's B at zero, A random
                reset_adapters(model, layer, adapters[layer])
                done.add(layer)
            continue
        hf_init = max(
            ((p, f) for p, f in hf_inits.items() if within(path, p)),
            key=lambda pf: len(pf[0]) if pf[0] else -1,
            default=(None, None),
        )[1]
        aside = parameters_aside(module, path, keep) if keep is not None else None
        with aside or contextlib.nullcontext():
            _initialise(path, module, init_fn, hf_init)


def _initialise(path: str, module: nn.Module, init_fn: InitFn | None, hf_init) -> None:
    if init_fn is not None:
        init_fn(module)
    elif hf_init is not None:
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


@contextlib.contextmanager
def parameters_aside(module: nn.Module, path: str, keep: set[str]) -> Iterator[None]:
    """Meta stand-ins for the parameters below `module` (at `path` in the model) not named
    in `keep`, while its initialiser runs. A Hugging Face `_init_weights` of one module may
    write parameters other than the ones being made: SigLIP's, run for its embeddings'
    buffers, draws the position embedding's weight, agreed over the ranks already; Laguna's
    router holds a trainable weight and a frozen bias, which sit in two units (trainable
    and frozen parameters never share one), and its initialiser writes both. Written, a
    released stage-3 parameter refuses the write, and one drawn again from each rank's own
    generator differs between ranks."""
    saved = []
    for sub_path, sub in module.named_modules(prefix=path):
        for name, param in list(sub.named_parameters(recurse=False)):
            if (f"{sub_path}.{name}" if sub_path else name) in keep:
                continue
            stand_in = torch.empty(param.shape, dtype=param.dtype, device="meta")
            saved.append((sub, name, param))
            setattr(sub, name, nn.Parameter(stand_in, requires_grad=param.requires_grad))
    try:
        yield
    finally:
        for sub, name, param in saved:
            setattr(sub, name, param)


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers (they hold a `base_layer` and initialise their adapters with
    `reset_lora_parameters`), by path."""
    return {
        path: m
        for path, m in model.named_modules()
        if callable(getattr(m, "reset_lora_parameters", None)) and hasattr(m, "base_layer")
    }


def _in_base(path: str, layer: str) -> bool:
    return within(path, f"{layer}.base_layer" if layer else "base_layer")


def reset_adapters(model: nn.Module, path: str, layer: nn.Module) -> None:
    """Initialise a meta-built LoRA layer's adapters as PEFT does, with the
    `init_lora_weights` of the PEFT config that made them (the nearest `peft_config`
    above the layer). Inits that read the base weights (PiSSA, OLoRA, ...) cannot run on
    a base that is loaded later: refused with the way out."""
    names = [*getattr(layer, "lora_A", {}), *getattr(layer, "lora_embedding_A", {})]
    configs: dict = {}
    for owner_path, owner in model.named_modules():
        if within(path, owner_path) and isinstance(getattr(owner, "peft_config", None), dict):
            configs = owner.peft_config  # the deepest holder wins: later ones are deeper
    for name in dict.fromkeys(names):
        init = getattr(configs.get(name), "init_lora_weights", True)
        if init not in (True, False, "gaussian"):
            raise ValueError(
                f"LoRA adapter '{name}' of '{path}' was built on the meta device with "
                f"init_lora_weights={init!r}, which reads the base weights; they are loaded "
                "only after sharding. Build this PEFT model on real memory, or initialise "
                "with init_lora_weights=True or 'gaussian'."
            )
        layer.reset_lora_parameters(name, init)


def detach_meta_buffers(
    model: nn.Module, device: torch.device, init_fn: InitFn | None
) -> list[str]:
    """Where the model's initialisation can recompute buffers (`init_fn`, or a Hugging
    Face model's `_init_weights`, which fills rotary frequencies and norm statistics),
    make its meta buffers real ones holding a sentinel (NaN, or the lowest integer), so
    that `unfilled_buffers` can tell any it leaves unfilled (a boolean mask has none:
    it is trusted to the initialiser, as `from_pretrained` trusts it); returns their
    names."""
    if init_fn is None and not any(hf_init_weights(m) is not None for m in model.modules()):
        return []
    names = []
    for path, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is None or not buf.is_meta:
                continue
            if buf.dtype == torch.bool:  # a mask (GPT-Neo's causal one): no sentinel, so
                real = torch.zeros_like(buf, device=device)  # trusted to the initialiser,
            else:  # as `from_pretrained` trusts it
                real = torch.empty_like(buf, device=device).fill_(_sentinel(buf.dtype))
            setattr(module, name, real)
            names.append(f"{path}.{name}" if path else name)
    return names


def buffer_owners(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules owning these buffers and no parameter (owners of both are initialised
    with their parameters), for `run_init` after the parameters."""
    paths = dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n in names)
    modules = [(path, model.get_submodule(path)) for path in paths]
    return [(p, m) for p, m in modules if next(m.parameters(recurse=False), None) is None]


def _sentinel(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


def unfilled_buffers(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Those of `names` (buffers `detach_meta_buffers` made real) that still hold the
    sentinel: nothing filled them since."""
    buffers = dict(model.named_buffers())
    return [
        name
        for name in names
        if (
            buffers[name].dtype != torch.bool
            and bool((buffers[name] == _sentinel(buffers[name].dtype)).any())
        )
        or bool(buffers[name].isnan().any())
    ]


class AwaitedBuffers:
    """Persistent buffers of a meta-built model that no initialiser filled: a checkpoint
    carries them (Apertus's activation constants, which `from_pretrained` loads too), so
    a load may fill them before the first forward, which asks (`check`)."""

    def __init__(self, model: nn.Module, names: Sequence[str] = ()):
        self.model = model
        self.names = list(names)

    def check(self) -> None:
        """Raises, naming them, while any of them still holds its placeholder."""
        if self.names:
            self.names = unfilled_buffers(self.model, self.names)
            if self.names:
                raise missing_buffers_error(self.names)


def awaiting_load(model: nn.Module, recomputed: Sequence[str] = ()) -> AwaitedBuffers:
    """Every buffer is real, and those `detach_meta_buffers` made real were filled, or are
    persistent (`AwaitedBuffers`); returns those. Raises for the rest."""
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    unfilled = unfilled_buffers(model, recomputed)
    awaiting = [name for name in unfilled if _persistent(model, name)]
    left = meta + [name for name in unfilled if name not in awaiting]
    if left:
        raise missing_buffers_error(left, bool(unfilled))
    return AwaitedBuffers(model, awaiting)


def missing_buffers_error(names: Sequence[str], unfilled: bool = True) -> ValueError:
    return ValueError(
        f"Buffers {list(names)[:5]} were built on the meta device and "
        + ("the model's initialisation did not fill them: " if unfilled else "")
        + "buffers are not sharded and cannot be recomputed after construction. Create "
        "them on the real device (e.g. register them after the meta context), recreate "
        "them in param_init_fn, or (persistent ones) load them with load_pretrained() or "
        "a checkpoint before the first forward."
    )


def _persistent(model: nn.Module, name: str) -> bool:
    path, _, attr = name.rpartition(".")
    return attr in model.get_submodule(path).state_dict(keep_vars=True)
