"""The engine's parts, put together in order. Read top to bottom, each step takes what
the steps before it made:

0. `prepare`: the config, the optimizers and the model's parameters checked (a compiled
   model taken out of its wrapper);
1. `process_groups`: the engine's own process groups;
2. `check_mesh`: what tensor parallelism cannot do, refused before any other collective;
3. `where_things_live` and `place_experts`: the stage this world runs, the homes of the
   shards, and which modules are sharded over which groups (MoE experts, placements);
4. `layouts`: the units and the flat layout of each;
5. `units`: one `FlatUnit` per layout;
6. `materialise` (in `materialise.py`): every unit's initial values, agreed over its group;
7. `shard_optimizers`: the user's optimizers re-pointed at this rank's master shards;
8. `disk_tiers`: the per-unit disk tiers;
9. `wire_model` (in `wiring.py`): the engine's hooks on the user's model and optimizers.

The engine calls them in this order; nothing here keeps state.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm.topology import ProcessGroups
from ..config import ZeroConfig
from ..layout.fp32_params import Fp32Parameters, fp32_patterns
from ..layout.partition import (
    FROZEN_GROUP,
    Segment,
    UnitLayout,
    bucket_layouts,
    fp32_owner_modules,
    frozen_leftover_modules,
    module_layouts,
    select_unit_modules,
    unique_parameters,
)
from ..layout.shard_spec import (
    PlacementFn,
    ShardSpec,
    placed_modules,
    placed_path_of_names,
    spec_of_owner,
)
from ..model_view.generation_sync import keep_generation_in_step
from ..moe.expert_placement import (
    ExpertNames,
    expert_layers,
    expert_parallel_partition,
    expert_placements,
    settle_expert_parallel,
)
from ..offload import (
    StagingBuffers,
    UnitTiers,
    free_large_blocks_at_once,
    keeps_stage_3,
    offloads_gradients,
    offloads_masters,
    optimizer_host,
    parameters_host,
    state_store,
    unit_tiers,
)
from ..optim import fused_step
from ..optim.grad_norm import GradNorm
from ..optim.optimizer_set import OptimizerSet
from ..optim.shard_views import (
    GroupsOfParams,
    check_host_optimizers,
    check_optimizer,
    group_index_of_params,
    repoint_optimizer,
)
from ..optim.zero_redundancy import stepping_optimizer
from ..tensor_parallel import MeshLayout, check_head_counts
from ..tensor_parallel import check_parameters as check_tensor_parameters
from ..units.flat_unit import FlatUnit
from ..units.optimizer_view import OptimizerView
from .compiled import unwrap_compiled


# ==================================================================== 0. prepare
@dataclass
class Prepared:
    config: ZeroConfig
    optimizers: list[torch.optim.Optimizer]  # what steps (the user's: `optimizer_set.facing`)
    optimizer_set: OptimizerSet
    params: list  # partition.ModelParam, each parameter once (tied ones too)
    device: torch.device
    module: nn.Module  # the model, out of a compiled wrapper (`compiled.py`)
    runner: Callable[..., Any]  # what a forward calls: the wrapper, or the module
    world: MeshLayout  # the ranks as a (data, tensor) grid: the mesh given, or contiguous
    # No optimizer given: a model that is only run (a DPO reference model, a teacher),
    # sharded all the same; a stand-in owns its parameters and never steps.
    evaluation_only: bool = False


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    config: ZeroConfig | dict | None,
    device: torch.device | str | None,
    device_mesh: Any = None,
) -> Prepared:
    """Check what the user handed over, before anything is communicated."""
    cfg = coerce_config(config)
    evaluation_only = optimizer is None
    if evaluation_only and isinstance(model, nn.Module):
        optimizer = torch.optim.SGD(list(model.parameters()), lr=0.0)
    facing = optimizer_list(optimizer, cfg)
    optimizers = [stepping_optimizer(opt) for opt in facing]
    for opt in optimizers:
        check_optimizer(opt, cfg.allow_untested_optimizer)
    optimizer_set = OptimizerSet(optimizers, facing)
    if not isinstance(model, nn.Module):
        raise TypeError(f"ZeroEngine needs an nn.Module, got {type(model).__name__}.")
    model, runner = unwrap_compiled(model)  # sharded under the model's own names
    world = MeshLayout.of_world(device_mesh, cfg.tensor_parallel_size)
    _settle_expert_parallel(model, optimizer_set, cfg.expert_parallel_size, world)
    params = unique_parameters(model)
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameters, so there is nothing to shard or "
            "train. Pass the model that holds the trainable parameters."
        )
    device = _resolve_device(params, device)
    return Prepared(
        cfg, optimizers, optimizer_set, params, device, model, runner, world, evaluation_only
    )


def coerce_config(config: ZeroConfig | dict | None) -> ZeroConfig:
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, dict):
        return ZeroConfig.from_dict(config)
    raise TypeError(f"config must be a ZeroConfig or a dict, got {type(config).__name__}.")


def optimizer_list(optimizer, cfg: ZeroConfig) -> list[torch.optim.Optimizer]:
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("ZeroEngine needs at least one optimizer; got an empty list.")
    if len(optimizers) > 1 and cfg.compute_torch_dtype == torch.float16:
        raise ValueError(
            "Several optimizers with fp16 are not supported: one dynamic loss scale cannot "
            "skip one optimizer's step and not the other's. Use bf16 (or fp32), or one "
            "optimizer with several param groups."
        )
    return optimizers


def _settle_expert_parallel(model, optimizer, ep_size: int, world: MeshLayout) -> None:
    """MoE layers built with ep_size=None keep this rank's experts; the optimizer, built
    over every expert, forgets the others (and takes a batched weight's slice for it).
    Experts are split over the data-parallel ranks: with tensor parallelism every
    tensor-parallel position holds the same ones."""
    replaced = settle_expert_parallel(model, ep_size, world.data_index, world.data_size)
    if replaced:
        for group in optimizer.param_groups:
            params = [replaced.get(id(p), p) for p in group["params"]]
            group["params"] = [p for p in params if p is not None]


def _resolve_device(params, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in params:
        if not p.param.is_meta:
            return p.param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ==================================================================== 1. groups
def process_groups(cfg: ZeroConfig, device: torch.device, world: MeshLayout) -> ProcessGroups:
    """The engine's own groups (with `collective_timeout`); it destroys them at close."""
    return ProcessGroups(
        device,
        cfg.collective_timeout,
        cfg.reduce_scatter_via_all_reduce,
        cfg.all_gather_via_broadcast,
        world,
        cfg.secondary_partition_size,
        cfg.quantized_weights,
        cfg.quantized_gradients,
    )


# ==================================================================== 2. mesh checks
def check_mesh(model: nn.Module, cfg: ZeroConfig, groups: ProcessGroups) -> None:
    """Refuse, before any other collective, what tensor parallelism cannot do here."""
    named = list(model.named_parameters())
    check_tensor_parameters(named, groups.mesh)
    if groups.mesh.tensor_size == 1:
        return
    # The (Hugging Face) config of the model, or of one held inside it (Lightning's).
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    check_head_counts(named, config, groups.mesh.tensor_size)


# ==================================================================== 3. where things live
@dataclass(frozen=True)
class Homes:
    """The stage this world runs and where each kind of tensor lives."""

    stage: int
    host: torch.device  # the optimizer's side: masters, gradient shards, state
    pin: bool  # host memory page-locked (asynchronous copies from an accelerator)
    shards_host: torch.device  # stage 3's parameter shards between gathers
    units_on_disk: bool  # a per-unit tier keeps shards in a file: the step goes unit by unit


def where_things_live(cfg: ZeroConfig, device: torch.device, world_size: int) -> Homes:
    # One process has nothing to shard: every parameter and gradient stays in place,
    # as in plain training, whatever stage was asked for (the checkpoints are the same);
    # unless its parameters are offloaded, which stage 3's gathers do unit by unit.
    stage = cfg.stage if world_size > 1 or keeps_stage_3(cfg, device) else 0
    host, pin = optimizer_host(cfg, device)
    shards_host = parameters_host(cfg, device, host)
    # Where the compute copies this rank steps into live: the device, or stage 3's
    # shards on the host (then the fp32 master is the shard itself, as on the CPU).
    compute_home = shards_host if stage == 3 else device
    units_on_disk = (
        cfg.offload_params == "disk"
        or offloads_gradients(cfg, stage)
        or offloads_masters(cfg, host, compute_home)
    )
    if units_on_disk:  # before the shards are made: their memory must leave with them
        free_large_blocks_at_once()
    return Homes(stage, host, pin, shards_host, units_on_disk)


@dataclass
class ExpertPlan:
    layers: dict  # module path -> MoE layer
    placed: dict[str, ShardSpec]  # module path -> the groups it is sharded over
    names: ExpertNames  # experts' global names, for checkpoints


def place_experts(
    model: nn.Module,
    prepared: Prepared,
    placement: PlacementFn | None,
    groups: ProcessGroups,
    stage: int,
) -> tuple[ExpertPlan, GroupsOfParams]:
    """Which modules are sharded over which groups, checked alike on every rank; the MoE
    layers bound to their expert-parallel groups. Returns the plan and each trainable
    parameter's optimizer groups."""
    params = prepared.params
    groups_of = group_index_of_params(prepared.optimizer_set, [p.param for p in params])
    group_of, later_of = groups_of.first, groups_of.later
    for p in params:
        if not p.param.requires_grad or prepared.evaluation_only:
            groups_of.drop(p.param)
    if later_of and prepared.config.ema_decay:
        raise ValueError(
            "ZeroConfig(ema_decay=...) updates the EMA after each optimizer's step, and "
            f"{len(later_of)} parameter(s) are stepped by two optimizers here. Give each "
            "optimizer its own parameters, or leave ema_decay unset and call "
            "engine.update_ema(decay) once per training step."
        )
    layers = expert_layers(model)
    placed = placed_modules(model, placement, groups.world_size)
    placed.update(expert_placements(layers, groups.world_size))
    # Cross-rank agreement first: a rank that raised alone would leave the others
    # waiting in the next collective until the timeout.
    _check_same_model_on_all_ranks(params, group_of, later_of, placed, groups, prepared)
    _warn_unoptimized(params, group_of)
    if not prepared.evaluation_only:
        _check_sizes(params, group_of)
    for layer in layers.values():  # before materialising: binding picks the experts
        if layer.ep_size > 1:
            partition = expert_parallel_partition(layer.ep_size, groups.world_size)
            layer.bind(groups.communicator(partition))
    if stage == 3 or any(layer.ep_size > 1 for layer in layers.values()):
        keep_generation_in_step(model)  # every forward is a collective
    return ExpertPlan(layers, placed, ExpertNames(layers)), groups_of


def _warn_unoptimized(params, group_of) -> None:
    missing = [p.names[0] for p in params if p.param.requires_grad and id(p.param) not in group_of]
    if missing:
        warnings.warn(
            f"{len(missing)} parameter(s) require grad but are in no optimizer group "
            f"(e.g. {missing[:3]}); they are treated as frozen. Add them to the optimizer "
            "or set requires_grad=False to silence this.",
            stacklevel=4,
        )


def _check_sizes(params, group_of) -> None:
    trainable = sum(p.param.numel() for p in params if id(p.param) in group_of)
    if trainable == 0:
        raise ValueError(
            "No parameter of the model is both trainable and in the optimizer. Build the "
            "optimizer over the model's parameters that require grad."
        )
    # A model with fewer elements than ranks is fine: a rank whose shard is padding
    # alone steps nothing (its optimizer holds empty views) and trains as DDP does.


def _check_same_model_on_all_ranks(params, group_of, later_of, placed, groups, prepared) -> None:
    """A different model (or placement) on some rank would pair mismatched collectives,
    or create mismatched groups: refuse early."""
    world = groups.world.comm
    if not world.distributed:
        return
    desc = (
        "|".join(
            f"{p.names[0]}:{tuple(p.local.shape)}:{p.param.dtype}:{group_of.get(id(p.param), FROZEN_GROUP)}:{later_of.get(id(p.param), ())}:{p.tensor}"
            for p in params
        )
        + "|"
        + "|".join(f"{path}:{spec.describe()}" for path, spec in placed.items())
    )
    digest = int.from_bytes(hashlib.sha1(desc.encode()).digest()[:7], "little")
    tags = world.control_all_gather(
        torch.tensor([digest, prepared.config.stage], dtype=torch.int64, device=prepared.device)
    ).tolist()
    if any(t != tags[0] for t in tags):
        raise ValueError(
            "The model, optimizer groups, placement or ZeRO stage differ across ranks "
            f"(per-rank [digest, stage]: {tags}). Every rank must build the same model, "
            "the same optimizer param groups, the same placement and the same ZeroConfig."
        )


# ==================================================================== 4. layouts
def layouts(
    model: nn.Module,
    cfg: ZeroConfig,
    stage: int,
    world_size: int,
    params,
    groups_of: GroupsOfParams,
    placed: dict[str, ShardSpec],
) -> list[UnitLayout]:
    """Units and their specs: stage 3 makes every placed module a unit of its own;
    stages 1-2 never put parameters of two specs in one bucket. A parameter several
    optimizers step sits at its first group's place, its slot naming the later ones."""
    lays = _unit_layouts(model, cfg, stage, world_size, params, groups_of.first, placed)
    later_of = groups_of.later
    later = {p.names[0]: later_of[id(p.param)] for p in params if id(p.param) in later_of}
    if later:
        for lay in lays:
            lay.name_later_groups(later)
    return lays


def _unit_layouts(model, cfg, stage, world_size, params, group_of, placed) -> list[UnitLayout]:
    world = ShardSpec.world(world_size)
    kept_fp32 = _kept_fp32(model, cfg, params)
    if cfg.stage == 3 and stage != 3:  # one process: check the names all the same
        select_unit_modules(model, cfg.unit_module_classes)
    if stage == 3:
        chosen = set(select_unit_modules(model, cfg.unit_module_classes)) | set(placed)
        chosen |= set(frozen_leftover_modules(model, chosen))
        chosen |= set(fp32_owner_modules(model, params, chosen, kept_fp32))
        unit_paths = [path for path, _ in model.named_modules() if path and path in chosen]

        def spec_of_unit(path: str) -> ShardSpec:
            governing = spec_of_owner(path, placed)
            return placed[governing] if governing is not None else world

        lays = module_layouts(model, params, group_of, unit_paths, spec_of_unit, kept_fp32)
        _warn_fp32_in_root(lays[0], kept_fp32)
        return lays

    def spec_of(p) -> ShardSpec:
        governing = placed_path_of_names(p.names, placed)
        return placed[governing] if governing is not None else world

    # Stage 0 is replicated: one "shard" per unit, no padding to the world size.
    return bucket_layouts(
        params, group_of, cfg.bucket_size, spec_of, sharded=stage > 0, kept_fp32=kept_fp32
    )


def _kept_fp32(model: nn.Module, cfg: ZeroConfig, params) -> Fp32Parameters:
    """The parameters that compute in fp32 under bf16/fp16 compute (`fp32_params.py`); a
    configured pattern that names no parameter is refused, as a misspelt one would be."""
    kept = Fp32Parameters(fp32_patterns(model, cfg.fp32_parameters, cfg.compute_torch_dtype))
    if cfg.fp32_parameters:
        missing = kept.unmatched(name for p in params for name in p.names)
        if missing:
            some = [name for p in params[:6] for name in p.names[:1]]
            raise ValueError(
                f"ZeroConfig.fp32_parameters has {missing}, which no parameter name "
                f"contains (the names start {some}); use patterns searched in the names "
                "of model.named_parameters()."
            )
    return kept


def _warn_fp32_in_root(root: UnitLayout, kept_fp32: Fp32Parameters) -> None:
    """Stage 3's root unit holds one dtype: a parameter of the root module itself (or
    tied across modules outside every unit) computes in the engine's dtype."""
    stay = [s.name for s in root.slots if kept_fp32((s.name, *s.aliases))]
    if stay:
        warnings.warn(
            f"ZeRO stage 3: {stay} should compute in fp32 but belong to the root unit "
            "(parameters of the root module itself, or tied across modules outside every "
            "unit), which computes in the engine's dtype. Move them into a submodule, or "
            "name that module in ZeroConfig.unit_module_classes.",
            stacklevel=5,
        )


def tensor_sharded(params) -> dict[str, Any]:
    """Tensor-parallel shards, by every name: checkpointed as blocks of the full tensor."""
    return {name: p.tensor for p in params if p.tensor and p.tensor.sharded for name in p.names}


# ==================================================================== 5. units
def units(
    model: nn.Module,
    lays: list[UnitLayout],
    homes: Homes,
    groups: ProcessGroups,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> list[FlatUnit]:
    return [
        FlatUnit(
            lay,
            [model.get_parameter(s.name) for s in lay.slots],
            homes.stage,
            groups.shard_group(lay.spec),
            device,
            lay.compute_dtype or compute_dtype,
            homes.host,
            homes.pin,
            homes.shards_host if homes.stage == 3 else None,
        )
        for lay in lays
    ]


# ==================================================================== 7. optimizers
@dataclass
class OptimizerSide:
    views: list[OptimizerView]  # the optimizers' parameters: views of the masters
    fused: list  # per optimizer, its fused Adam step (None where torch's own steps)
    state_store: Any  # where the optimizer state lives: memory or a file
    norm: GradNorm


def optimizer_side(
    prepared: Prepared,
    units: list[FlatUnit],
    homes: Homes,
    groups: ProcessGroups,
    on_memory: Callable[[], None],
) -> OptimizerSide:
    """The optimizers re-pointed at this rank's masters, with their fused steps (the
    masters on the training device) and the tier of their state."""
    cfg, device = prepared.config, prepared.device
    views = shard_optimizers(prepared.optimizer_set, units, cfg, homes.units_on_disk)
    # The fused kernel steps masters on the training device; offloaded, the CPU steps.
    on_device = homes.host == device
    fused = [fused_step.build(o, own_hooks=1) if on_device else None for o in prepared.optimizers]
    if not on_device:
        check_host_optimizers(prepared.optimizers)
    store = state_store(cfg, prepared.optimizer_set.state, views, groups.global_rank, on_memory)
    norm = GradNorm(
        units,
        homes.stage,
        groups,
        cfg.master_torch_dtype,
        device,
        homes.host,
        offloads_gradients(cfg, homes.stage),
    )
    return OptimizerSide(views, fused, store, norm)


def shard_optimizers(
    optimizer_set: OptimizerSet, units: list[FlatUnit], cfg: ZeroConfig, in_unit_order: bool
) -> list[OptimizerView]:
    """Point the optimizers at 1-D views of the fp32 masters, one per (unit, group)
    segment, and remember which gradient slice belongs to each. A parameter that later
    optimizers step too gets a view per later group over the same elements."""
    by_group: dict[int, list[tuple[FlatUnit, int, int, Segment]]] = {}
    # State streamed from disk is stepped a tile at a time: no view may be larger.
    most = cfg.offload_tile_size if cfg.offload_optimizer == "disk" else 0

    def add(gi: int, unit: FlatUnit, lo: int, hi: int, seg: Segment) -> None:
        cuts = range(lo, hi, most) if most and hi > lo else [lo]
        by_group.setdefault(gi, []).extend(
            (unit, a, min(hi, a + most) if most else hi, seg) for a in cuts
        )

    for unit in units:
        segments = unit.layout.segments(unit.opt_start, unit.opt_end)
        for seg in segments:
            add(seg.group_index, unit, seg.start - unit.opt_start, seg.end - unit.opt_start, seg)
        for seg in segments:  # after every first group's: a view per later group
            for gi in seg.later_groups:
                add(gi, unit, seg.start - unit.opt_start, seg.end - unit.opt_start, seg)
    # Every group has a view on every rank (an empty one where none of its elements
    # is this rank's), so that a group's requires_grad (Lightning's toggle_optimizer)
    # reads the same everywhere.
    for gi, group in enumerate(optimizer_set.param_groups):
        if gi not in by_group and group["params"]:
            holders = (u for u in units for s in u.layout.slots if gi in s.groups)
            first = next(holders, None)
            if first is not None:  # (none: an evaluation-only engine's stand-in)
                by_group[gi] = [(first, 0, 0, Segment(gi, 0, 0))]
    for k, opt in enumerate(optimizer_set.optimizers):
        offset = optimizer_set.group_offsets[k]
        repoint_optimizer(
            opt,
            {
                gi - offset: [u.master[lo:hi] for u, lo, hi, _ in by_group[gi]]
                for gi in optimizer_set.groups_of(k)
                if gi in by_group
            },
        )
    all_groups = optimizer_set.param_groups
    views = [
        OptimizerView(
            unit,
            lo,
            hi,
            opt_param,
            gi,
            unit.grad_opt_untouched[lo:hi] if unit.grad_opt_untouched is not None else None,
            alias_of=None if gi == seg.group_index else seg.group_index,
        )
        for gi, segs in by_group.items()
        for (unit, lo, hi, seg), opt_param in zip(segs, all_groups[gi]["params"])
    ]
    # Stepped unit by unit, each shard (parameters, masters, gradients) read once.
    if in_unit_order:
        views.sort(key=lambda view: view.unit.layout.index)
    return views


# ==================================================================== 8. disk tiers
def disk_tiers(
    cfg: ZeroConfig, units: list[FlatUnit], stage: int, rank: int, on_memory: Callable[[], None]
) -> tuple[StagingBuffers, UnitTiers]:
    """The per-unit disk tiers (None where the tensors stay in memory): the bf16/fp16
    masters between steps, stage 3's parameter shards between uses, and the gradients'
    fp32 shards from their reduction to the step (the norm noted as they land), through
    one set of host buffers."""
    staging = StagingBuffers(cfg.offload_buffer_count, on_memory=on_memory)
    return staging, unit_tiers(cfg, units, stage, rank, staging, on_memory)
