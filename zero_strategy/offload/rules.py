"""Where each kind of tensor lives, by the config and the training device: the rules the
engine, the tiers and the planner's checks share.

On the CPU there is one memory: "cpu" offload leaves everything where it is, and only
the disk moves anything. On an accelerator, offload_optimizer (or offload_params) puts
the optimizer's side in host memory, where the step runs, and offload_params stage 3's
parameter shards there too, copied to the device for each gather."""

from __future__ import annotations

import torch

from ..config import ZeroConfig


def optimizer_host(config: ZeroConfig, device: torch.device) -> tuple[torch.device, bool]:
    """Where the optimizer's side (fp32 masters, fp32 gradient shards, the optimizer's
    state) lives, and whether in page-locked memory: on the training device, or with the
    optimizer (or the parameters) offloaded from an accelerator in host memory, where the
    step runs; pinned unless a disk tier resizes that memory."""
    offloaded = (config.offload_optimizer, config.offload_params)
    if offloaded == ("none", "none") or device.type == "cpu":
        return device, False
    return torch.device("cpu"), "disk" not in offloaded


def parameters_host(config: ZeroConfig, device: torch.device, host: torch.device) -> torch.device:
    """Where stage 3's parameter shards (the compute copies) live between gathers: on the
    training device, or with offload_params from an accelerator on the optimizer's
    `host`, each copied to the device for its gather."""
    if config.offload_params == "none" or device.type == "cpu":
        return device
    return host


def keeps_stage_3(config: ZeroConfig, device: torch.device) -> bool:
    """Whether one process keeps stage 3 (which otherwise trains unsharded): when its
    parameter shards leave the training device's memory for the disk or the host."""
    return config.offload_params == "disk" or (
        config.offload_params == "cpu" and device.type != "cpu"
    )


def offloads_masters(config: ZeroConfig, host: torch.device, compute: torch.device) -> bool:
    """Whether the fp32 masters go to disk: with offload_optimizer="disk" whenever they
    are tensors of their own (bf16/fp16 compute, or the optimizer's side on a `host`
    apart from where the `compute` copies live), as DeepSpeed keeps them with the
    optimizer state. In fp32 with both in one memory the master is the compute copy:
    stage 3's offload_params="disk" moves it. (`FlatUnit.master_apart` is the same rule,
    unit by unit.)"""
    mixed = config.compute_torch_dtype != config.master_torch_dtype
    return config.offload_optimizer == "disk" and (mixed or host != compute)


def offloads_gradients(config: ZeroConfig, stage: int) -> bool:
    """Whether the gradients' fp32 shards go to disk: at stages 2-3 (as run) with
    offload_optimizer="disk". Stages 0-1 keep whole gradients, as DDP does, for their
    all-reduce."""
    return config.offload_optimizer == "disk" and stage >= 2
