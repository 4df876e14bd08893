"""From a framework strategy's arguments to the engine's `ZeroConfig`.

Lightning's `ZeroStrategy` and Fabric's `ZeroFabricStrategy` take the same arguments (a
stage, a config or DeepSpeed config, any ZeroConfig field as a keyword), read the same
precision flags and register under the same names, so both read them here and report a
wrong value with the same message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import PurePath
from typing import Any

import torch

from zero_strategy import ZeroConfig
from zero_strategy.deepspeed_config import from_deepspeed_config, looks_like_deepspeed_config

PRECISIONS = {
    # Lightning/Fabric flag -> (engine compute dtype, autocast dtype or None)
    "32-true": ("fp32", None),
    "32": ("fp32", None),
    "bf16-mixed": ("fp32", torch.bfloat16),
    "bf16-true": ("bf16", None),
    "16-mixed": ("fp16", None),  # fp16 compute, fp32 masters, dynamic loss scaling
    "16-true": ("fp16", None),
    "64-true": ("fp64", None),  # fp64 compute and fp64 masters
    "64": ("fp64", None),
}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype set to `dtype` inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def precision_flag(plugin: object, entry: str) -> str:
    """The precision flag of the framework's plugin, refused here, at set-up, if the engine
    has no compute dtype for it: an unknown flag must not silently train in fp32. `entry`
    ("Trainer", "Fabric") names where the user sets it."""
    flag = str(getattr(plugin, "precision", "32-true"))
    if flag not in PRECISIONS:
        raise ValueError(
            f"{entry}(precision={flag!r}) is not supported by the ZeRO strategy; set "
            f"precision to one of {sorted(PRECISIONS)}."
        )
    return flag


def compute_dtype_for(flag: str, base: ZeroConfig, entry: str) -> str:
    """The framework's precision flag decides the engine's compute dtype; a different one
    asked for in the strategy's config (e.g. a DeepSpeed config with bf16 enabled) is
    named in a warning rather than dropped silently."""
    compute = PRECISIONS[flag][0]
    if base.compute_dtype not in ("fp32", compute):
        warnings.warn(
            f"The ZeRO config asks for compute_dtype={base.compute_dtype!r}, but "
            f"{entry}(precision={flag!r}) decides the precision and gives {compute!r}. Set "
            f"{entry}(precision=...) to choose (e.g. 'bf16-true' or 'bf16-mixed').",
            stacklevel=3,
        )
    return compute


def config_for_precision(plugin: object, base: ZeroConfig, entry: str) -> tuple[str, ZeroConfig]:
    """The framework's precision flag, and the engine's config with the compute dtype
    that flag gives (`compute_dtype_for`)."""
    flag = precision_flag(plugin, entry)
    compute = compute_dtype_for(flag, base, entry)
    return flag, ZeroConfig.from_dict({**vars(base), "compute_dtype": compute})


def zero_config_from(
    stage: int | None, config: ZeroConfig | Mapping | str | PurePath | None, options: dict
) -> ZeroConfig:
    """One ZeroConfig from the strategy's arguments, validated when the strategy is built
    rather than at set-up; unknown options list the known ones. `config` may also be a
    DeepSpeed config (a dict with `zero_optimization`, or the path of its JSON file)."""
    values: dict[str, Any] = {}
    if isinstance(config, (str, PurePath)) or (
        isinstance(config, Mapping) and looks_like_deepspeed_config(config)
    ):
        config = from_deepspeed_config(config)
    if isinstance(config, ZeroConfig):
        values.update(vars(config))
    elif config is not None:
        values.update(dict(config))
    values.update(options)
    if stage is not None:
        values["stage"] = stage
    return ZeroConfig.from_dict(values)


def register_zero_names(cls: type, registry: Any) -> None:
    """zero1..zero3 in a Lightning or Fabric strategy registry (both take the same
    `register(name, cls, description=..., **init_kwargs)`)."""
    for stage in (1, 2, 3):
        registry.register(
            f"zero{stage}", cls, description=f"ZeRO stage {stage} (zero-strategy)", stage=stage
        )


def signature_with_config_fields(init: Callable[..., Any]) -> inspect.Signature:
    """`__init__(..., **zero_options)` with each ZeroConfig field spelled out as a typed
    keyword, so that tools that read signatures (LightningCLI / jsonargparse configs with
    `class_path: ...ZeroStrategy`, `init_args: {stage: 3, bucket_size: ...}`) accept them."""
    base = inspect.signature(init)
    hints = typing.get_type_hints(ZeroConfig)
    params = [p for p in base.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in params}
    for f in dataclasses.fields(ZeroConfig):
        if f.name in named:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[f.name]
            )
        )
    return base.replace(parameters=params)
