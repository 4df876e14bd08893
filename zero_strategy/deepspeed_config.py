"""A DeepSpeed config (the `ds_config.json` of a project moving over) read as a `ZeroConfig`.

Every ZeRO key with an equivalent here is translated; keys that only tune DeepSpeed's own
implementation (its buffers, its bucketing of all-gathers) have no counterpart and are
listed in one warning; what cannot be honoured (fp16 and bf16 at once) is an error that
says so. The optimizer's and the parameters' offload map to `offload_optimizer` and
`offload_params` ("nvme" is the disk tier, its `nvme_path` the `offload_dir`). Trainer
settings that live in the same file (batch sizes, optimizer, scheduler) belong to the
training loop and are listed as ignored too.
Hugging Face's `"auto"` placeholders keep the ZeroConfig default.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ZeroConfig, ZeroConfigError

# zero_optimization key -> ZeroConfig field (DeepSpeed accepts the stage3_ keys without
# their prefix too)
_ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "bucket_size",
    "overlap_comm": "overlap_comm",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "max_reuse_distance": "max_reuse_distance",
    "zero_hpz_partition_size": "secondary_partition_size",
    "zero_quantized_weights": "quantized_weights",
    "zero_quantized_gradients": "quantized_gradients",
}
# Keys whose behaviour is built in or has no meaning here. The persistence threshold is
# one of them: DeepSpeed applies it per parameter, ZeroConfig.persistence_threshold per
# unit, so DeepSpeed's usual 1e5 would mean something else here.
_NO_COUNTERPART = {
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "prefetch_bucket_size",
    "max_live_parameters",
    "model_persistence_threshold",
    "gather_16bit_weights_on_model_save",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "round_robin_gradients",
    "ignore_unused_parameters",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_model_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear",
    "elastic_checkpoint",
    "load_from_fp32_weights",
    "legacy_stage1",
}
# Top-level keys that configure the training loop, not ZeRO.
_TRAINER_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
}


def from_deepspeed_config(config: Mapping[str, Any] | str | os.PathLike) -> ZeroConfig:
    """The ZeroConfig for a DeepSpeed config dict or JSON file."""
    if not isinstance(config, Mapping):
        config = json.loads(Path(config).read_text())
    values: dict[str, Any] = {"stage": 0}  # DeepSpeed's default: no ZeRO
    ignored: list[str] = []
    zero = dict(config.get("zero_optimization") or {})
    for key, value in zero.items():
        if _is_auto(value) or value is None:  # "auto", or DeepSpeed's choice by stage
            continue
        if key in _ZERO_KEYS:
            values[_ZERO_KEYS[key]] = _as_int(value) if key != "overlap_comm" else value
        elif key in ("offload_optimizer", "cpu_offload"):
            _offload(key, value, "offload_optimizer", values, ignored)
        elif key in ("offload_param", "cpu_offload_param"):
            _offload(key, value, "offload_params", values, ignored)
        elif key == "sub_group_size":
            values["offload_tile_size"] = _as_int(value)
        elif key in _NO_COUNTERPART:
            ignored.append(f"zero_optimization.{key}")
        else:
            ignored.append(f"zero_optimization.{key} (unknown)")
    if values.get("offload_params", "none") != "none" and values.get("stage") != 3:
        values.pop("offload_params")  # DeepSpeed, too, offloads parameters at stage 3 only
        ignored.append("zero_optimization.offload_param (parameters are offloaded at stage 3)")
    _precision(config, values, ignored)
    if "gradient_clipping" not in config:
        warnings.warn(
            "The DeepSpeed config sets no gradient_clipping; recent DeepSpeed releases then "
            "clip at 1.0, zero-strategy does not clip. Set gradient_clipping to choose.",
            stacklevel=2,
        )
    for key, value in config.items():
        if key in ("zero_optimization", "fp16", "bf16", "bfloat16") or _is_auto(value):
            continue
        if key == "torch_autocast" and isinstance(value, Mapping) and value.get("enabled"):
            raise ZeroConfigError(
                "The DeepSpeed config enables torch_autocast; zero-strategy leaves autocast to "
                "the training framework (Trainer(precision='bf16-mixed'), "
                "Accelerator(mixed_precision='bf16')). Remove the key and set it there."
            )
        if key == "gradient_clipping":
            values["gradient_clipping"] = float(value)
        elif key == "zero_allow_untested_optimizer":
            values["allow_untested_optimizer"] = bool(value)
        elif key == "communication_data_type" and value is not None:
            values["reduce_dtype"] = str(value)
        elif key in _TRAINER_KEYS:
            ignored.append(f"{key} (a training-loop setting: set it in your trainer)")
        else:
            ignored.append(f"{key} (unknown)")
    if ignored:
        warnings.warn(
            "DeepSpeed config keys without a ZeroConfig counterpart were ignored: "
            + ", ".join(ignored)
            + ". Remove them from the config to silence this, or set what they meant in "
            "ZeroConfig (zero-strategy's own fields are listed in its docs).",
            stacklevel=2,
        )
    try:
        return ZeroConfig.from_dict(values)
    except ZeroConfigError as e:
        keys = [
            f"zero_optimization.{k}" for k, f in _ZERO_KEYS.items() if f"ZeroConfig.{f}=" in str(e)
        ]
        source = f" ({' or '.join(keys)} there)" if keys else ""
        raise ZeroConfigError(f"From the DeepSpeed config{source}: {e}") from None


def looks_like_deepspeed_config(config: Mapping[str, Any]) -> bool:
    return any(key in config for key in ("zero_optimization", "fp16", "bf16", "bfloat16"))


def _precision(config: Mapping[str, Any], values: dict[str, Any], ignored: list[str]) -> None:
    fp16 = dict(config.get("fp16") or {})
    bf16 = dict(config.get("bf16") or config.get("bfloat16") or {})
    fp16_on, bf16_on = fp16.get("enabled") is True, bf16.get("enabled") is True
    if fp16_on and bf16_on:
        raise ZeroConfigError(
            "The DeepSpeed config enables both fp16 and bf16; enable one of them."
        )
    if bf16_on:
        values["compute_dtype"] = "bf16"
    ignored += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    if not fp16_on:
        return
    values["compute_dtype"] = "fp16"
    scale = fp16.get("loss_scale", 0)
    if not _is_auto(scale):
        values["loss_scale"] = "dynamic" if float(scale) == 0 else str(float(scale))
    for key, field in (
        ("initial_scale_power", "initial_loss_scale_power"),
        ("loss_scale_window", "loss_scale_window"),
        ("min_loss_scale", "min_loss_scale"),
    ):
        if fp16.get(key) is not None and not _is_auto(fp16[key]):
            values[field] = _as_int(fp16[key]) if key != "min_loss_scale" else fp16[key]
    mapped = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window"}
    ignored += [f"fp16.{k}" for k in fp16 if k not in mapped | {"min_loss_scale", "auto_cast"}]


# offload_optimizer keys -> ZeroConfig field; the rest are listed as ignored, with why.
_OFFLOAD_KEYS = {"device": None, "nvme_path": "offload_dir", "buffer_count": "offload_buffer_count"}
_OFFLOAD_IGNORED = {
    "pin_memory": "host buffers are pinned only for a CUDA device to copy from",
    "buffer_size": "each buffer holds the largest unit's shard",
    "max_in_cpu": "a shard is in memory only while it is in use",
    "pipeline_read": "reads and writes always overlap the step here",
    "pipeline_write": "reads and writes always overlap the step here",
    "pipeline": "reads and writes always overlap the step here",
    "fast_init": "the state is created by the first step, a tile at a time",
    "ratio": "the whole optimizer state is offloaded",
}


def _offload(
    key: str, value: Any, field_name: str, values: dict[str, Any], ignored: list[str]
) -> None:
    """zero_optimization.offload_optimizer / offload_param (or the deprecated cpu_offload
    and cpu_offload_param flags) -> the `field_name` tier and its settings."""
    settings = dict(value) if isinstance(value, Mapping) else {"device": "cpu" if value else None}
    device = settings.get("device")
    if device in (None, "none", False):
        return
    tiers = {"cpu": "cpu", "nvme": "disk"}
    if device not in tiers:
        raise ZeroConfigError(
            f"The DeepSpeed config asks for zero_optimization.{key}.device {device!r}; use "
            "'none', 'cpu' or 'nvme' (a directory on a local disk, in nvme_path)."
        )
    values[field_name] = tiers[device]
    for name, setting in settings.items():
        if name in _OFFLOAD_KEYS:
            target = _OFFLOAD_KEYS[name]
            if target is None or _is_auto(setting) or (name == "nvme_path" and device == "cpu"):
                continue  # nvme_path means nothing for host memory
            setting = _as_int(setting) if name == "buffer_count" else str(setting)
            if values.get(target, setting) != setting:
                raise ZeroConfigError(
                    f"The DeepSpeed config sets zero_optimization.{key}.{name} to {setting!r} "
                    f"and the other offload's to {values[target]!r}; zero-strategy has one "
                    f"ZeroConfig.{target} for both. Use the same value in both."
                )
            values[target] = setting
        elif name in _OFFLOAD_IGNORED:
            ignored.append(f"zero_optimization.{key}.{name} ({_OFFLOAD_IGNORED[name]})")
        else:
            ignored.append(f"zero_optimization.{key}.{name} (unknown)")


def _is_auto(value: Any) -> bool:
    return value == "auto"


def _as_int(value: Any) -> Any:
    """5e7 (JSON writes it as a float) -> 50000000; anything else is left for ZeroConfig
    to refuse with the field's name."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
