"""`ZeroConfig`: every knob of the engine, validated once at construction.

A plain dataclass of primitives (no unions of objects) so that OmegaConf accepts it as a
structured config and Hydra can register it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "float16": torch.float16,
}


OFFLOAD_TIERS = ("none", "cpu", "disk")


class ZeroConfigError(ValueError):
    """An invalid `ZeroConfig` value; the message names the field and the fix."""


def parse_dtype(value: str | torch.dtype | None, field_name: str) -> torch.dtype | None:
    """Map "bf16"/"fp16"/"fp32" (or a torch dtype) to a torch dtype, or raise naming the field."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in _DTYPES.values():
            raise ZeroConfigError(
                f"{field_name}={value} is not supported; use one of 'fp32', 'bf16', 'fp16', 'fp64'."
            )
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ZeroConfigError(
            f"{field_name}={value!r} is not a known dtype; use one of 'fp32', 'bf16', 'fp16', "
            "'fp64'."
        ) from None


@dataclass
class ZeroConfig:
    """What to shard and how to move it.

    Stage 0 is plain replicated data parallelism (the reference); stage 1 shards optimizer
    state, stage 2 also gradients, stage 3 also parameters.
    """

    stage: int = 3
    # Stages 1-2: parameters are grouped into flat buckets of about this many elements;
    # each bucket is reduced by one collective as soon as all its gradients are ready.
    bucket_size: int = 25_000_000
    # Launch gradient reductions during backward (True) or all at the end of backward.
    overlap_comm: bool = True
    # Stages 1-2: gather the updated parameters during the next forward (each module
    # waits for its own) rather than at the end of `step()`.
    overlap_param_gather: bool = True
    # Stage 3: how many units to gather ahead of use, in the order recorded on step 1.
    prefetch_depth: int = 1
    # Stage 3: units with fewer elements than this stay gathered (no re-gather per pass).
    persistence_threshold: int = 0
    # Stage 3: keep a unit gathered from forward into backward when fewer than this many
    # parameter elements are gathered between the two uses (DeepSpeed's
    # stage3_max_reuse_distance). 0 frees every unit after its forward: least memory, two
    # gathers per step. A value above twice the model size gathers once per step, at the
    # cost of holding the whole model in compute dtype at the end of forward.
    max_reuse_distance: int = 0
    # Stage 3: names of module classes that become units; empty = every child of every
    # nn.ModuleList (the transformer blocks of most models), with the rest in the root unit.
    unit_module_classes: list[str] = field(default_factory=list)
    # Stage 3: exchange a small tag before each gather so that ranks taking different
    # module paths get an error naming the modules instead of a hang.
    verify_module_order: bool = True
    compute_dtype: str = "fp32"
    # bf16/fp16 compute: patterns (regular expressions, `*` as in a glob) searched in
    # parameter names; a parameter any of whose names matches computes in fp32 (MoE
    # routers, attention sinks). None: the model's own marks, as Transformers loads it
    # (`_keep_in_fp32_modules_strict`, and at fp16 `_keep_in_fp32_modules`), and PEFT's
    # adapters, as PEFT keeps them; [] none.
    fp32_parameters: list[str] | None = None
    # Dtype of gradient reductions; None = the compute dtype.
    reduce_dtype: str | None = None
    # fp16 only: "dynamic" or a fixed positive number.
    loss_scale: str = "dynamic"
    initial_loss_scale_power: int = 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    # Global-norm clipping over all shards at `step()`; 0 disables it.
    gradient_clipping: float = 0.0
    # Seconds before a collective that a peer never joins raises instead of hanging.
    collective_timeout: float = 600.0
    # How gradients are reduce-scattered. None = the fastest for the backend: on gloo,
    # whose own reduce-scatter is slow, point-to-point sends (each rank sends every other
    # rank that rank's slice and adds up what it receives: half an all-reduce's bytes);
    # elsewhere the backend's reduce-scatter. True = an in-place all-reduce; False = the
    # backend's reduce-scatter.
    reduce_scatter_via_all_reduce: bool | None = None
    # All-gather implemented as one in-place broadcast per rank: about 3x faster on gloo.
    # None = on for gloo, off otherwise.
    all_gather_via_broadcast: bool | None = None
    # For a slow link between nodes (ZeRO++, docs/multi_node.md). Stage 3: ranks per node
    # (torchrun's --nproc-per-node); above 1, parameters are gathered across nodes, then
    # within the node, and a unit's column of the across-node hop (its secondary
    # partition, 1/this of the unit) is kept from forward to backward, whose gather then
    # stays within the node; stages 2-3 reduce gradients within the node, then across.
    secondary_partition_size: int = 1
    # Stage 3: the across-node hop of parameter gathers carries block-wise int8 (qwZ).
    quantized_weights: bool = False
    # Stages 2-3: the across-node hop of gradient reductions carries block-wise int8 (qgZ).
    quantized_gradients: bool = False
    # Broadcast rank 0's buffers (e.g. BatchNorm statistics) before each training forward,
    # as DDP's default broadcast_buffers=True does.
    broadcast_buffers: bool = True
    # Stages 2-3: after each synchronised backward, put the full reduced gradient on every
    # parameter's .grad, as DDP shows it (for clipping checks, dtype checks, comparisons).
    # Costs DDP's gradient memory (the compute dtype, whole model) on every rank, and at
    # stage 3 also the full parameters, from the end of backward to the step.
    keep_full_grads: bool = False
    # Update a sharded EMA of the weights after every step with this decay (0 = off); see
    # engine.update_ema() / engine.ema_weights() to drive it yourself.
    ema_decay: float = 0.0
    # Optimizers outside torch's elementwise set are refused unless this is True.
    allow_untested_optimizer: bool = False
    # MoE layers built with ep_size=None split their experts over this many contiguous
    # ranks (expert parallelism); 1 keeps every expert on every rank.
    expert_parallel_size: int = 1
    # Tensor parallelism (torch's, applied by the user's plan): ranks per tensor-parallel
    # group, contiguous; ZeRO shards over the data-parallel ranks at each position. Give
    # the engine a 2-D device_mesh instead for another layout. 1 = none.
    tensor_parallel_size: int = 1
    # Where the optimizer's state lives: "none" (in memory, beside the masters), "cpu"
    # (host memory: the same memory when training on the CPU) or "disk" (files per rank
    # under offload_dir, streamed tile by tile at each step, as ZeRO-Infinity's NVMe tier
    # does). "disk" also takes the fp32 masters there in bf16/fp16 (any stage), and at
    # stages 2-3 the gradients' fp32 shards from their reduction to the step.
    offload_optimizer: str = "none"
    # Stage 3: where each unit's parameter shard (and its fp32 master, unless
    # offload_optimizer="disk" keeps it) lives between uses: "none", "cpu" (as above) or
    # "disk" (a file per rank under offload_dir, read just before the unit's gather and
    # its step, written back after the step).
    offload_params: str = "none"
    # offload_*="disk": a directory on a local disk with room for this rank's offloaded
    # state (Adam: 8 bytes per parameter, the masters 4 more, split over the ranks). The
    # engine removes its files when it closes.
    offload_dir: str | None = None
    # Parameter elements whose state is stepped at once (DeepSpeed's sub_group_size); a
    # tile never splits one optimizer view (a unit's part of a param group).
    offload_tile_size: int = 4_000_000
    # Host buffers of one tile each for the disk tier: the tile stepping, the next ones
    # being read and the previous one being written (at least 2).
    offload_buffer_count: int = 4

    def __post_init__(self) -> None:
        # Any sequence of names (a Hydra/OmegaConf ListConfig, a tuple) becomes a list.
        if isinstance(self.unit_module_classes, Sequence) and not isinstance(
            self.unit_module_classes, str
        ):
            self.unit_module_classes = list(self.unit_module_classes)
        if isinstance(self.fp32_parameters, Sequence) and not isinstance(self.fp32_parameters, str):
            self.fp32_parameters = list(self.fp32_parameters)
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            self.offload_dir = os.fspath(self.offload_dir)  # a Path
        self._validate()

    # ----------------------------------------------------------------- validation
    def _validate(self) -> None:
        def fail(name: str, fix: str) -> None:
            raise ZeroConfigError(f"ZeroConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            fail(
                "stage",
                "use 0 (replicated), 1 (optimizer state), 2 (+gradients) or 3 (+parameters).",
            )
        for name in ("bucket_size",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, "use a positive number of elements, e.g. 25_000_000.")
        for name in ("expert_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, "use a positive number of ranks that divides the world size.")
        if (
            not isinstance(self.secondary_partition_size, int)
            or isinstance(self.secondary_partition_size, bool)
            or self.secondary_partition_size <= 0
        ):
            fail("secondary_partition_size", "use the ranks per node, e.g. 8 (1 turns it off).")
        if self.secondary_partition_size > 1 and self.stage < 2:
            fail("secondary_partition_size", "it needs stage 3 (or 2 for the reductions).")
        for name, lowest in (("quantized_weights", 3), ("quantized_gradients", 2)):
            if not isinstance(getattr(self, name), bool):
                fail(name, "use True or False.")
            if getattr(self, name) and self.stage < lowest:
                fail(name, f"it needs stage {lowest} or higher; use stage={lowest}.")
        for name in ("prefetch_depth", "persistence_threshold", "max_reuse_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(name, "use a non-negative integer (0 disables it).")
        for name in (
            "overlap_comm",
            "overlap_param_gather",
            "verify_module_order",
            "broadcast_buffers",
            "allow_untested_optimizer",
        ):
            if not isinstance(getattr(self, name), bool):
                fail(name, "use True or False.")
        for name in ("reduce_scatter_via_all_reduce", "all_gather_via_broadcast"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                fail(name, "use None (automatic), True or False.")
        if not isinstance(self.unit_module_classes, (list, tuple)) or not all(
            isinstance(n, str) and n for n in self.unit_module_classes
        ):
            fail("unit_module_classes", "use a list of module class names, e.g. ['Block'].")
        if self.fp32_parameters is not None and not _valid_patterns(self.fp32_parameters):
            fail(
                "fp32_parameters",
                "use a list of regular expressions searched in parameter names, e.g. "
                "['mlp.gate.weight'], [] for none, or None for the model's own marks.",
            )
        parse_dtype(self.compute_dtype, "ZeroConfig.compute_dtype")
        parse_dtype(self.reduce_dtype, "ZeroConfig.reduce_dtype")
        self._validate_loss_scaling(fail)
        if (
            not _is_number(self.gradient_clipping)
            or self.gradient_clipping < 0
            or self.gradient_clipping != self.gradient_clipping
        ):
            fail("gradient_clipping", "use 0 (off) or a positive max norm such as 1.0.")
        if not _is_number(self.ema_decay) or not 0.0 <= self.ema_decay < 1.0:
            fail("ema_decay", "use 0 (off) or a decay in (0, 1) such as 0.999.")
        if not _is_number(self.collective_timeout) or self.collective_timeout <= 0:
            fail("collective_timeout", "use a positive number of seconds, e.g. 600.")
        self._validate_offload(fail)

    def _validate_loss_scaling(self, fail) -> None:
        """fp16's loss scale: a fixed one, or the dynamic one's start, window and floor."""
        if str(self.loss_scale) != "dynamic":
            try:
                scale = float(self.loss_scale)
            except (TypeError, ValueError):
                scale = -1.0
            if not scale > 0 or scale != scale or scale == float("inf"):
                fail("loss_scale", "use 'dynamic' or a finite positive number such as 1024.")
        if (
            not isinstance(self.initial_loss_scale_power, int)
            or not 0 <= self.initial_loss_scale_power <= 64
        ):
            fail(
                "initial_loss_scale_power",
                "use an integer between 0 and 64 (the scale is 2**power).",
            )
        if not isinstance(self.loss_scale_window, int) or self.loss_scale_window <= 0:
            fail("loss_scale_window", "use a positive number of steps, e.g. 1000.")
        if not _is_number(self.min_loss_scale) or self.min_loss_scale <= 0:
            fail("min_loss_scale", "use a positive number, e.g. 1.0.")

    def _validate_offload(self, fail) -> None:
        if self.offload_optimizer not in OFFLOAD_TIERS:
            fail(
                "offload_optimizer",
                "use 'none' (in memory), 'cpu' (host memory) or 'disk' (files under offload_dir).",
            )
        if self.offload_params not in OFFLOAD_TIERS:
            fail(
                "offload_params",
                "use 'none' (in memory), 'cpu' (host memory) or 'disk' (files under offload_dir).",
            )
        if self.offload_params != "none" and self.stage != 3:
            fail(
                "offload_params",
                f"parameters are offloaded at stage 3 only (between their gathers); at stage "
                f"{self.stage} every rank keeps them whole. Use stage=3, or offload_optimizer.",
            )
        for field_name in ("offload_optimizer", "offload_params"):
            if getattr(self, field_name) == "disk" and not self.offload_dir:
                fail(
                    "offload_dir",
                    f"{field_name}='disk' needs a directory on a local disk with room for "
                    "this rank's offloaded state, e.g. offload_dir='/local_nvme/offload'.",
                )
        if (
            not isinstance(self.offload_tile_size, int)
            or isinstance(self.offload_tile_size, bool)
            or self.offload_tile_size <= 0
        ):
            fail("offload_tile_size", "use a positive number of elements, e.g. 4_000_000.")
        if (
            not isinstance(self.offload_buffer_count, int)
            or isinstance(self.offload_buffer_count, bool)
            or self.offload_buffer_count < 2
        ):
            fail(
                "offload_buffer_count",
                "use 2 or more (one tile steps while the next is read and the last written).",
            )

    # ----------------------------------------------------------------- derived
    @property
    def compute_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.compute_dtype, "compute_dtype")  # type: ignore[return-value]

    @property
    def master_torch_dtype(self) -> torch.dtype:
        """The optimizer's masters and gradients: fp32, or fp64 for fp64 compute."""
        return torch.float64 if self.compute_torch_dtype == torch.float64 else torch.float32

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.reduce_dtype, "reduce_dtype") or self.compute_torch_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute_torch_dtype == torch.float16

    @classmethod
    def from_dict(cls, values: dict) -> ZeroConfig:
        """Build from a mapping, rejecting unknown keys with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ZeroConfigError(
                f"Unknown ZeroConfig option(s) {unknown}; known options are {sorted(known)}."
            )
        return cls(**values)


def pattern_regex(patterns: Sequence[str]) -> re.Pattern | None:
    """One expression searching for any of `patterns` (None when there are none), `*`
    standing for any run of characters as in Transformers' marks; raises re.error for a
    pattern that is not a regular expression."""
    bodies = [f"(?:{p.replace('*', '.*')})" for p in patterns]
    return re.compile("|".join(bodies)) if bodies else None


def _valid_patterns(patterns: object) -> bool:
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        return False
    try:
        pattern_regex(patterns)
    except re.error:
        return False
    return True


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
