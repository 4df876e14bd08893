"""A model of cost: per-rank memory by kind and communication per step, for any model
size, world size and stage, before anything is allocated.

Two accountings:
- "zero-strategy" (default): this engine's layout, validated against `memory_report()`
  and `comm_report()` of real runs (tests/test_planner.py).
- "zero-paper": the ZeRO paper's mixed-precision Adam model (2 bytes of parameters, 2 of
  gradients, K=12 of fp32 master and moments per parameter), for comparison with its
  figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

GB = 1e9
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Elementwise optimizer state, fp32 bytes per parameter.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,
    "adam": 8,
    "sgd": 0,
    "sgd-momentum": 4,
    "adagrad": 4,
    "rmsprop": 4,
    "adamax": 8,
    "nadam": 8,
    "radam": 8,
}


OFFLOADS = ("none", "disk", "disk+params", "cpu", "optimizer", "optimizer+params")


class PlanError(ValueError):
    """Invalid planner input; the message names the field and the fix."""


@dataclass
class Plan:
    params: int
    world_size: int
    stage: int
    compute_dtype: str
    memory: dict[str, float] = field(default_factory=dict)  # bytes per rank by kind
    comm: dict[str, float] = field(default_factory=dict)  # bytes per step by collective
    device_memory: float | None = None
    host_memory: dict[str, float] = field(default_factory=dict)  # offloaded, per rank
    disk: dict[str, float] = field(default_factory=dict)  # offloaded to files, per rank
    # Stage 3 on several nodes: bytes a rank receives from other nodes per step, by hop
    # ("gather", "reduce"; memory/across_nodes.py).
    across_node: dict[str, float] = field(default_factory=dict)

    @property
    def model_state(self) -> float:
        """Device bytes of model state (offloaded kinds are in host_memory)."""
        return sum(v for k, v in self.memory.items() if k != "activations")

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "model_state": self.model_state,
            "total": self.total,
            "fits": self.fits,
        }


def tensor_shardable_params(model: nn.Module) -> int:
    """The parameters a standard tensor-parallel plan splits: the weights of every
    nn.Linear inside the stage-3 units (a transformer block's attention and MLP
    projections, column- or row-wise; their biases and the norms stay whole), but the
    experts' (whole at every tensor position, as Transformers' plans leave them)."""
    from ..layout.partition import select_unit_modules

    units = [model.get_submodule(p) for p in select_unit_modules(model, [])]
    in_experts = {id(m) for e in _experts_modules(model) for m in e.modules()}
    return sum(
        m.weight.numel()
        for unit in units
        for m in unit.modules()
        if isinstance(m, nn.Linear) and id(m) not in in_experts
    )


def expert_params(model: nn.Module) -> int:
    """The parameters of the model's experts (`zero_strategy.moe.MoE` layers' and
    Transformers experts modules'): those expert parallelism splits."""
    return sum(p.numel() for e in _experts_modules(model) for p in e.parameters())


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    from ..moe.expert_placement import expert_modules

    return list(expert_modules(model).values())


def count_params(model: nn.Module) -> tuple[int, int]:
    """(parameters, parameters of the stage-3 root unit), each tied tensor once; works on
    a model built on the meta device."""
    from ..layout.partition import module_layouts, select_unit_modules, unique_parameters
    from ..layout.shard_spec import ShardSpec

    params = unique_parameters(model)
    one = ShardSpec.world(1)
    layouts = module_layouts(model, params, {}, select_unit_modules(model, []), lambda _path: one)
    return sum(p.param.numel() for p in params), layouts[0].numel


def plan(
    params: int,
    world_size: int,
    stage: int,
    compute_dtype: str = "fp32",
    optimizer: str = "adamw",
    accounting: str = "zero-strategy",
    root_params: int = 0,
    activations: float = 0.0,
    device_memory: float | None = None,
    ep_size: int = 1,
    expert_params: int = 0,
    offload: str = "none",
    shard_group_size: int | None = None,
    tensor_parallel_size: int = 1,
    tensor_sharded_params: int | None = None,
) -> Plan:
    """Per-rank bytes by kind and per-step communication (one micro-batch, gradients
    reduced once) for a model of `params` parameters, `expert_params` of them in MoE
    experts split over `ep_size` expert-parallel ranks. `shard_group_size` shards the dense
    parameters over groups of that many ranks, one full copy per group (hybrid sharding,
    a `ShardSpec.contiguous(world_size, g)` placement of the root); default: the world.

    `tensor_parallel_size` t: a tensor-parallel plan splits `tensor_sharded_params` of
    the parameters (default: all but the root's and the experts') over t ranks; ZeRO
    then shards what one rank holds over the world / t data-parallel ranks, and expert
    parallelism splits the experts (whole at every tensor position) over `ep_size` of
    those. The plan's communication is ZeRO's; the plan's own (activations) is not
    counted."""
    _validate(params, world_size, stage, compute_dtype, optimizer, accounting, root_params)
    if tensor_parallel_size != 1:
        return _with_tensor_parallel(
            params,
            world_size,
            tensor_parallel_size,
            tensor_sharded_params,
            dict(
                stage=stage,
                compute_dtype=compute_dtype,
                optimizer=optimizer,
                accounting=accounting,
                root_params=root_params,
                activations=activations,
                device_memory=device_memory,
                offload=offload,
            ),
            ep_size,
            expert_params,
            shard_group_size is not None,
        )
    g = world_size if shard_group_size is None else shard_group_size
    _check_groups(g, shard_group_size, world_size, ep_size, expert_params, params, offload, stage)
    # What one rank would hold unsharded: the dense part and its own experts.
    psi = float(params - expert_params) + expert_params / ep_size
    # dense over its shard group; experts over n / ep_size ranks, of 1/ep_size of them
    shard = (params - expert_params) / g + expert_params / float(world_size)
    # One process keeps everything in place, unless its parameters are offloaded.
    ran = stage if world_size > 1 or offload == "disk+params" else 0
    memory = _model_state(psi, shard, stage, ran, compute_dtype, optimizer, accounting)
    if activations:
        memory["activations"] = activations
    opt_range = psi if ran == 0 else shard  # what this rank's optimizer steps
    host, disk = _offloaded(memory, offload, ran, opt_range, psi, compute_dtype, accounting)
    comm = _communication(
        params, expert_params, psi, g, world_size, stage, root_params, compute_dtype, accounting
    )
    return Plan(params, world_size, stage, compute_dtype, memory, comm, device_memory, host, disk)


def _check_groups(
    g, shard_group_size, world_size, ep_size, expert_params, params, offload, stage
) -> None:
    """The grouping and offload arguments, each refused with the values that work."""
    if not isinstance(g, int) or g <= 0 or world_size % g:
        raise PlanError(
            f"shard_group_size={shard_group_size!r} is invalid: it must divide "
            f"world_size={world_size}: use one of "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    if not isinstance(ep_size, int) or ep_size <= 0 or world_size % ep_size:
        raise PlanError(
            f"ep_size={ep_size!r} is invalid: it must divide world_size={world_size} (expert "
            "groups are contiguous ranks), e.g. 1, 2 or 4 for 8 ranks."
        )
    if not isinstance(expert_params, int) or not 0 <= expert_params <= params:
        raise PlanError(
            f"expert_params={expert_params!r} is invalid: use a count between 0 and params."
        )
    if offload not in OFFLOADS:
        raise PlanError(
            f"offload={offload!r} is invalid: use 'none', 'disk' (the optimizer state in "
            "files, as ZeroConfig(offload_optimizer='disk')), 'disk+params' (stage 3's "
            "parameter shards too, offload_params='disk'), 'cpu' or 'optimizer' (masters "
            "and optimizer state in host memory, as ZeRO-Offload on a GPU) or "
            "'optimizer+params' (parameters too, ZeRO-Infinity style)."
        )
    if offload == "disk+params" and stage != 3:
        raise PlanError(
            f"offload='disk+params' is invalid at stage {stage}: parameters are offloaded at "
            "stage 3 only. Use stage=3, or offload='disk'."
        )


def _model_state(psi, shard, stage, ran, compute_dtype, optimizer, accounting) -> dict[str, float]:
    """Bytes of each model-state kind on one rank, in device memory."""
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    if accounting == "zero-paper":
        # Mixed-precision Adam: 2 + 2 + K bytes, K = 12 (fp32 master, momentum, variance).
        k = 4 + opt
        return {
            "parameters": 2 * (shard if stage >= 3 else psi),
            "gradients": 2 * (shard if stage >= 2 else psi),
            "optimizer_state": k * (shard if stage >= 1 else psi),
        }
    c = _DTYPE_BYTES[compute_dtype]
    mixed = c != 4
    opt_range = psi if ran == 0 else shard  # what this rank's optimizer steps
    return {
        "parameters": c * (shard if ran == 3 else psi),
        "master_params": 4 * opt_range if mixed else 0.0,
        # stages 0-1 keep full gradients in the compute dtype (plus an fp32 slice
        # when mixed); stages 2-3 keep only the fp32 slice
        "gradients": (c * psi + (4 * opt_range if mixed else 0)) if ran < 2 else 4 * shard,
        "optimizer_state": opt * opt_range,
    }


def _offloaded(memory, offload, ran, opt_range, psi, compute_dtype, accounting):
    """Move the offloaded kinds out of `memory`: (host memory, disk) bytes by kind."""
    host: dict[str, float] = {}
    disk: dict[str, float] = {}
    if offload in ("disk", "disk+params"):
        disk["optimizer_state"] = memory.pop("optimizer_state")
        # Stages 2-3 (as run: one process runs stage 0 unless its parameters are
        # offloaded) keep the gradients' fp32 shards there too.
        if ran >= 2:
            disk["gradients"] = memory.pop("gradients")
        # Mixed precision: the fp32 masters, tensors of their own, go with the state.
        if memory.get("master_params"):
            disk["master_params"] = memory.pop("master_params")
    if offload == "disk+params":
        disk["parameters"] = memory.pop("parameters")
    elif offload not in ("none", "disk"):  # to host memory
        moved = ("optimizer_state", "master_params") + (
            ("parameters",) if offload == "optimizer+params" else ()
        )
        for kind in moved:
            if kind in memory:
                host[kind] = memory.pop(kind)
        if accounting != "zero-paper":
            # As the engine does on a GPU: the fp32 masters and gradient shards are tensors
            # of their own in host memory (fp32 too), the device keeps the compute-dtype
            # gradient buffers at stages 0-1 and none at stages 2-3.
            host["master_params"] = 4 * opt_range
            host["gradients"] = 4 * opt_range
            memory["gradients"] = _DTYPE_BYTES[compute_dtype] * psi if ran < 2 else 0.0
    return host, disk


def _communication(
    params, expert_params, psi, g, world_size, stage, root_params, compute_dtype, accounting
) -> dict[str, float]:
    """Bytes each rank sends per step (one micro-batch, gradients reduced once), by kind."""
    dtype_bytes = 2 if accounting == "zero-paper" else _DTYPE_BYTES[compute_dtype]
    comm: dict[str, float] = {}
    if world_size > 1:
        full = dtype_bytes * psi
        if stage <= 1:
            comm["all_reduce"] = full
        else:
            comm["reduce_scatter"] = full
            if g < world_size:  # each reduced shard is summed over the other copies
                comm["all_reduce"] = dtype_bytes * (params - expert_params) / g
        if stage in (1, 2):
            comm["all_gather"] = full
        elif stage == 3:
            comm["all_gather"] = 2 * full - dtype_bytes * root_params
    return comm


def _with_tensor_parallel(
    params: int,
    world_size: int,
    t: int,
    sharded: int | None,
    options: dict,
    ep_size: int,
    expert_params: int,
    hybrid: bool,
) -> Plan:
    """One tensor-parallel rank's plan: its part of the model over its data-parallel
    ranks, its experts (whole at every position) over `ep_size` of them."""
    if not isinstance(t, int) or isinstance(t, bool) or t <= 0 or world_size % t:
        raise PlanError(
            f"tensor_parallel_size={t!r} is invalid: it must divide world_size={world_size}: "
            f"use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    if hybrid:
        raise PlanError(
            "tensor_parallel_size with hybrid sharding (shard_group_size) is not modelled "
            "by the planner: plan them apart."
        )
    data = world_size // t
    if not isinstance(ep_size, int) or ep_size <= 0 or data % ep_size:
        raise PlanError(
            f"ep_size={ep_size!r} is invalid: it must divide the {data} data-parallel ranks "
            f"(world_size={world_size} / tensor_parallel_size={t}): use one of "
            f"{[d for d in range(1, data + 1) if data % d == 0]}."
        )
    dense = params - expert_params if isinstance(expert_params, int) else params
    if sharded is None:
        sharded = max(0, dense - options["root_params"])
    if not isinstance(sharded, int) or not 0 <= sharded <= dense:
        raise PlanError(
            f"tensor_sharded_params={sharded!r} is invalid: use a count between 0 and the "
            f"{dense} parameters outside the experts (the experts stay whole at every "
            "tensor position)."
        )
    local = params - sharded + -(-sharded // t)
    root = min(options["root_params"], local)
    one = plan(
        local,
        data,
        **{**options, "root_params": root},
        ep_size=ep_size,
        expert_params=expert_params,
    )
    one.params, one.world_size = params, world_size
    return one


def cheapest_stage(params: int, world_size: int, device_memory: float, **kwargs) -> int | None:
    """The lowest stage (least communication) whose plan fits, or None."""
    for stage in (0, 1, 2, 3):
        if plan(params, world_size, stage, device_memory=device_memory, **kwargs).fits:
            return stage
    return None


def activation_bytes(batch: int, seq: int, hidden: int, layers: int, dtype_bytes: int = 2) -> float:
    """A transformer's saved activations without recomputation, about 34·b·s·h bytes per
    layer at 2 bytes per value (Korthikanti et al., attention scores left out)."""
    return 34.0 * batch * seq * hidden * layers * dtype_bytes / 2


def _validate(params, world_size, stage, compute_dtype, optimizer, accounting, root_params) -> None:
    def fail(name: str, value, fix: str) -> None:
        raise PlanError(f"{name}={value!r} is invalid: {fix}")

    if not isinstance(params, int) or params <= 0:
        fail("params", params, "use a positive number of parameters, e.g. 7_500_000_000.")
    if not isinstance(world_size, int) or world_size <= 0:
        fail("world_size", world_size, "use a positive number of ranks.")
    if stage not in (0, 1, 2, 3):
        fail("stage", stage, "use 0, 1, 2 or 3.")
    if compute_dtype not in _DTYPE_BYTES:
        fail("compute_dtype", compute_dtype, f"use one of {sorted(_DTYPE_BYTES)}.")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        fail("optimizer", optimizer, f"use one of {sorted(OPTIMIZER_STATE_BYTES)}.")
    if accounting not in ("zero-strategy", "zero-paper"):
        fail("accounting", accounting, "use 'zero-strategy' or 'zero-paper'.")
    if not isinstance(root_params, int) or not 0 <= root_params <= params:
        fail("root_params", root_params, "use a count between 0 and params.")


def format_table(p: Plan) -> str:
    rows = [
        f"{p.params:,} parameters, {p.world_size} ranks, stage {p.stage}, {p.compute_dtype}",
        "per-rank memory:",
    ]
    rows += [f"  {k:<18} {v / GB:10.3f} GB" for k, v in p.memory.items()]
    rows.append(f"  {'total':<18} {p.total / GB:10.3f} GB")
    if p.host_memory:
        rows.append("offloaded to host memory per rank:")
        rows += [f"  {k:<18} {v / GB:10.3f} GB" for k, v in p.host_memory.items()]
    if p.disk:
        rows.append("offloaded to disk per rank:")
        rows += [f"  {k:<18} {v / GB:10.3f} GB" for k, v in p.disk.items()]
    if p.device_memory is not None:
        rows.append(f"  fits in {p.device_memory / GB:.0f} GB: {'yes' if p.fits else 'NO'}")
    rows.append("communication per step:")
    rows += [f"  {k:<18} {v / GB:10.3f} GB" for k, v in p.comm.items()] or ["  none (one rank)"]
    if p.across_node:
        rows.append("received from other nodes per step and rank:")
        rows += [f"  {k:<18} {v / GB:10.3f} GB" for k, v in p.across_node.items()]
    return "\n".join(rows)


def parse_count(text: str) -> int:
    """'7.5B', '350M', '1T', '125000' -> an integer count."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    text = text.strip().upper()
    try:
        if text and text[-1] in scale:
            return round(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        raise PlanError(
            f"params={text!r} is invalid: use a number such as 7.5B, 350M or 125000."
        ) from None
