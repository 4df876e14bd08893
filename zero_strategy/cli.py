"""`zero-strategy` command line: consolidate and inspect sharded checkpoints, estimate
memory and communication; `env` reports what this machine offers the engine."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from . import __version__


def _env(_: argparse.Namespace) -> int:
    print(f"zero-strategy {__version__}")
    print(f"torch {torch.__version__}")
    print(f"cuda available: {torch.cuda.is_available()}")
    backends = [b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")()]
    print(f"distributed backends: {', '.join(backends) or 'none'}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from .checkpoint.consolidate import consolidate

    files = consolidate(
        args.checkpoint,
        args.out,
        fmt=args.format,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        exclude_frozen=args.exclude_frozen,
        show_progress=not args.quiet,
        weights="ema" if args.ema else "model",
        with_optimizer=args.with_optimizer,
    )
    for f in files:
        print(f)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import summary

    print(summary(args.checkpoint))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import json

    from .memory import planner

    root, sharded, model, experts = 0, None, None, args.expert_params
    if args.hf_config:
        model = _model_of_hf_config(args.hf_config)
        params, root, sharded = _params_of(model)
        if experts is None:  # the model's own experts
            experts = planner.expert_params(model)
    elif args.params:
        params = planner.parse_count(args.params)
    else:
        raise ValueError("give --params (e.g. 7.5B) or --hf-config config.json")
    activations = 0.0
    if args.batch and args.seq and args.hidden and args.layers:
        activations = planner.activation_bytes(args.batch, args.seq, args.hidden, args.layers)
    stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    device = args.device_memory * planner.GB if args.device_memory else None
    plans = [
        planner.plan(
            params,
            args.world_size * args.nodes,
            s,
            args.dtype,
            args.optimizer,
            args.accounting,
            root,
            activations,
            device,
            args.ep_size,
            experts or 0,
            offload=args.offload,
            shard_group_size=args.shard_group_size,
            tensor_parallel_size=args.tensor_parallel,
            tensor_sharded_params=(
                planner.parse_count(args.tensor_sharded_params)
                if args.tensor_sharded_params
                else sharded
            ),
        )
        for s in stages
    ]
    for p in plans:
        if p.stage == 3 and args.nodes > 1:
            p.across_node = _across_nodes(args, model, params, root)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=1))
    else:
        print("\n\n".join(planner.format_table(p) for p in plans))
        if device is not None:
            best = next((p.stage for p in plans if p.fits), None)
            print(f"\ncheapest stage that fits: {best if best is not None else 'none'}")
    return 0


def _model_of_hf_config(path: str):
    """The model a Hugging Face config.json describes, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _params_of(model) -> tuple[int, int, int]:
    """(parameters, the root unit's, those a standard tensor-parallel plan splits)."""
    from .memory.planner import count_params, tensor_shardable_params

    return (*count_params(model), tensor_shardable_params(model))


def _across_nodes(args: argparse.Namespace, model, params: int, root: int) -> dict[str, float]:
    """Stage 3's bytes per step and rank from other nodes: from the model's padded units
    (exact), or from the counts alone (the root, and the rest as one unit)."""
    from .memory.across_nodes import LinkSetup, padded_unit_numels

    world = args.world_size * args.nodes
    link = LinkSetup(
        world,
        args.world_size,
        args.secondary_partition_size,
        args.quantized_weights,
        args.quantized_gradients,
        args.dtype,
    )
    units = padded_unit_numels(model, world) if model is not None else [root, params - root]
    return dict(link.step_bytes(units))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:  # CheckpointError is a RuntimeError
        print(f"zero-strategy {args.command}: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy", description="ZeRO sharding for PyTorch.")
    parser.add_argument("--version", action="version", version=f"zero-strategy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)
    _add_consolidate(sub)
    _add_inspect(sub)
    _add_estimate(sub)
    return parser


def _add_consolidate(sub) -> None:
    c = sub.add_parser(
        "consolidate",
        help="write one model file from a sharded checkpoint, one tensor in memory at a time",
    )
    c.add_argument("checkpoint", help="checkpoint directory written by save_checkpoint")
    c.add_argument("out", help="output directory (safetensors) or file (torch, lightning)")
    c.add_argument("--format", choices=["safetensors", "torch", "lightning"], default="safetensors")
    c.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="cast parameters (default: their own dtype)",
    )
    c.add_argument(
        "--max-shard-size",
        default="5GB",
        help="safetensors: split into Hugging Face shards past this size (e.g. 500MB)",
    )
    c.add_argument("--exclude-frozen", action="store_true", help="leave out frozen parameters")
    c.add_argument(
        "--ema", action="store_true", help="write the EMA of the weights saved with them"
    )
    c.add_argument(
        "--with-optimizer",
        action="store_true",
        help="lightning: the optimizer state too, whole (what state_dict_type='full' writes)",
    )
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_consolidate)


def _add_inspect(sub) -> None:
    i = sub.add_parser(
        "inspect", help="summarize a checkpoint: world size, stage, sizes, completeness"
    )
    i.add_argument("checkpoint")
    i.set_defaults(func=_inspect)


def _add_estimate(sub) -> None:
    from .memory.planner import OFFLOADS

    e = sub.add_parser("estimate", help="per-rank memory and communication for a model size")
    e.add_argument("--params", help="parameter count, e.g. 7.5B, 350M")
    e.add_argument("--hf-config", help="a Hugging Face config.json (model built on meta)")
    e.add_argument("--world-size", type=int, default=1, help="ranks per node")
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument("--stage", default="all", choices=["0", "1", "2", "3", "all"])
    e.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    e.add_argument("--optimizer", default="adamw")
    e.add_argument("--accounting", default="zero-strategy", choices=["zero-strategy", "zero-paper"])
    e.add_argument("--ep-size", type=int, default=1)
    e.add_argument(
        "--expert-params",
        type=int,
        default=None,
        help="parameters in MoE experts (default with --hf-config: the model's experts; "
        "with --params: 0)",
    )
    e.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        help="shard over groups of this many ranks, one copy per group (hybrid sharding)",
    )
    e.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="ranks per tensor-parallel group; ZeRO shards over world / N",
    )
    e.add_argument(
        "--tensor-sharded-params",
        help="parameters the tensor-parallel plan splits (default with --hf-config: every "
        "nn.Linear weight in the blocks; with --params: all but the root's)",
    )
    e.add_argument(
        "--secondary-partition-size",
        type=int,
        default=1,
        help="stage 3 on --nodes > 1: the across-node bytes with this hierarchy (the ranks "
        "per node; docs/multi_node.md)",
    )
    e.add_argument("--quantized-weights", action="store_true", help="int8 over the link")
    e.add_argument("--quantized-gradients", action="store_true", help="int8 over the link")
    e.add_argument("--device-memory", type=float, help="GB per device, to check the fit")
    e.add_argument(
        "--offload",
        default="none",
        choices=list(OFFLOADS),
        help="disk: the optimizer state in files, the fp32 masters in bf16/fp16, and at "
        "stages 2-3 the gradients' fp32 shards (offload_optimizer='disk'); disk+params: "
        "stage 3's parameter shards too (offload_params='disk'); cpu/optimizer: "
        "masters and optimizer state in host memory; optimizer+params: parameters too",
    )
    e.add_argument("--batch", type=int, default=0)
    e.add_argument("--seq", type=int, default=0)
    e.add_argument("--hidden", type=int, default=0)
    e.add_argument("--layers", type=int, default=0)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_estimate)


if __name__ == "__main__":
    sys.exit(main())
