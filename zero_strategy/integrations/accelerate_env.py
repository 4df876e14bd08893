"""Accelerate's DeepSpeed settings, read as ZeroConfig values for a `ZeroAccelerator`.

Why: a user whose `accelerate config` chose DeepSpeed ZeRO swaps `Accelerator()` for
`ZeroAccelerator()` and keeps launching with the same config. `accelerate launch` then
exports `ACCELERATE_USE_DEEPSPEED=true` with the `ACCELERATE_DEEPSPEED_*` settings
(`prepare_deepspeed_cmd_env` in accelerate/utils/launch.py), which Accelerate's
`DeepSpeedPlugin` reads back. Here they are read as that plugin reads them, into the
DeepSpeed config it would build, and handed to `from_deepspeed_config`, so the stage and
clipping are the ones the DeepSpeed run had:

- `ACCELERATE_DEEPSPEED_ZERO_STAGE` (unset: 2, Accelerate's default);
- `ACCELERATE_GRADIENT_CLIPPING` (unset: 1.0, the value Accelerate fills its "auto" with);
- `ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE` and `_OFFLOAD_PARAM_DEVICE` ("cpu", or
  "nvme" with `_OFFLOAD_OPTIMIZER_NVME_PATH` / `_OFFLOAD_PARAM_NVME_PATH`):
  `offload_optimizer` and `offload_params`, as in a DeepSpeed config;
- `ACCELERATE_DEEPSPEED_CONFIG_FILE`: a ds_config.json, used instead of the variables
  above, which fill only its "auto" values (as Accelerate does);
- `ACCELERATE_DEEPSPEED_ZERO3_INIT`, `ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL` and
  `ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES` have no counterpart: one warning names them
  and says what happens instead.

`ACCELERATE_MIXED_PRECISION` and `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` are read by
`Accelerator` itself, as without DeepSpeed.

Accelerate must not also set up DeepSpeed: `Accelerator.__init__` builds a
`DeepSpeedPlugin` whenever `ACCELERATE_USE_DEEPSPEED` is true, and `AcceleratorState` then
switches `distributed_type` to DEEPSPEED (on any device but `cpu=True`). No argument turns
that off (`deepspeed_plugin=None` is the default that reads the variable), so
`take_deepspeed_env()` consumes it: it sets `ACCELERATE_USE_DEEPSPEED=false` and
`ZERO_STRATEGY_FROM_ACCELERATE_DEEPSPEED=true`, the latter so that a later
`ZeroAccelerator` in the process (a second Trainer) reads the same settings. A
`PartialState` created before the first `ZeroAccelerator` has read the variable already.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from zero_strategy import ZeroConfig, ZeroConfigError
from zero_strategy.deepspeed_config import from_deepspeed_config

ENV_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ENV_TAKEN = "ZERO_STRATEGY_FROM_ACCELERATE_DEEPSPEED"
ENV_STAGE = "ACCELERATE_DEEPSPEED_ZERO_STAGE"
ENV_CLIPPING = "ACCELERATE_GRADIENT_CLIPPING"
ENV_OFFLOAD_OPTIMIZER = "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"
ENV_OFFLOAD_OPTIMIZER_PATH = "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"
ENV_OFFLOAD_PARAM = "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"
ENV_OFFLOAD_PARAM_PATH = "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"
ENV_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ENV_ZERO3_INIT = "ACCELERATE_DEEPSPEED_ZERO3_INIT"
ENV_SAVE_16BIT = "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"
ENV_MOE_CLASSES = "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"
_SAVE_16BIT_KEY = "zero_optimization.stage3_gather_16bit_weights_on_model_save"


def take_deepspeed_env() -> dict[str, Any]:
    """The ZeroConfig fields (those differing from the defaults) that Accelerate's DeepSpeed
    settings translate to, {} without them; consumes `ACCELERATE_USE_DEEPSPEED` (see the
    module docstring). Call it before `Accelerator.__init__`."""
    if not (_true(ENV_USE_DEEPSPEED) or _true(ENV_TAKEN)):
        return {}
    values = deepspeed_env_values()
    os.environ[ENV_USE_DEEPSPEED] = "false"
    os.environ[ENV_TAKEN] = "true"
    return values


def deepspeed_env_values() -> dict[str, Any]:
    """The translation alone: reads the environment, changes nothing."""
    config = _deepspeed_config()
    try:
        translated = vars(from_deepspeed_config(config))
    except ZeroConfigError as e:
        settings = ", ".join(
            f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ACCELERATE_DEEP")
        )
        raise ZeroConfigError(f"Accelerate's DeepSpeed settings ({settings}): {e}") from None
    _warn_unhonoured(config, translated["stage"])
    defaults = vars(ZeroConfig())
    return {k: v for k, v in translated.items() if v != defaults[k]}


def _deepspeed_config() -> dict[str, Any]:
    """The DeepSpeed config Accelerate's `DeepSpeedPlugin` builds from the environment."""
    env = {
        "zero_optimization.stage": int(os.environ.get(ENV_STAGE, 2)),
        "gradient_clipping": _clipping(),
        "zero_optimization.offload_optimizer.device": _env(ENV_OFFLOAD_OPTIMIZER, "none"),
        "zero_optimization.offload_param.device": _env(ENV_OFFLOAD_PARAM, "none"),
    }
    for section, variable in (
        ("offload_optimizer", ENV_OFFLOAD_OPTIMIZER_PATH),
        ("offload_param", ENV_OFFLOAD_PARAM_PATH),
    ):
        if variable in os.environ:
            env[f"zero_optimization.{section}.nvme_path"] = os.environ[variable]
    path = os.environ.get(ENV_CONFIG_FILE, "none")
    if path == "none":
        config: dict[str, Any] = {}
        for key, value in env.items():
            _set(config, key, value)
        return config
    config = json.loads(Path(path).read_text())
    for key, value in env.items():  # the variables fill the file's "auto" values only
        if _get(config, key) == "auto":
            _set(config, key, value)
    return config


def _warn_unhonoured(config: dict[str, Any], stage: int) -> None:
    unhonoured = []
    # Accelerate's default: deepspeed.zero.Init at stage 3 (it turns the flag off below).
    if stage == 3 and _true(ENV_ZERO3_INIT, default=True):
        unhonoured.append(
            f"{ENV_ZERO3_INIT} (deepspeed.zero.Init): the model is built whole in each "
            "process, as the script builds it, and sharded by prepare()"
        )
    if _true(ENV_SAVE_16BIT) or _get(config, _SAVE_16BIT_KEY) is True:
        unhonoured.append(
            f"{ENV_SAVE_16BIT} ({_SAVE_16BIT_KEY}): get_state_dict/save_model always "
            "consolidate the whole model on the main process, in the engine's compute dtype "
            "(fp32 under mixed_precision 'no' or 'bf16'); save_state writes the sharded "
            "checkpoint"
        )
    if os.environ.get(ENV_MOE_CLASSES):
        unhonoured.append(
            f"{ENV_MOE_CLASSES}: stage 3 gathers each unit whole (by default each child of "
            "an nn.ModuleList, such as a transformer block with its MoE layer)"
        )
    if unhonoured:
        warnings.warn(
            "Accelerate's DeepSpeed settings without a zero-strategy counterpart: "
            + "; ".join(unhonoured)
            + ".",
            stacklevel=3,
        )


def _clipping() -> Any:
    value = os.environ.get(ENV_CLIPPING, "auto")
    return 1.0 if value == "auto" else float(value)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default).lower()


def _true(name: str, default: bool = False) -> bool:
    return os.environ.get(name, str(default)).lower() in ("y", "yes", "t", "true", "on", "1")


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value
