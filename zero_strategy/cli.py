"""`zero-strategy` command line: consolidate and inspect sharded checkpoints; `env` reports
what this machine offers the engine."""

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
    from .consolidate import consolidate

    files = consolidate(
        args.checkpoint,
        args.out,
        fmt=args.format,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        exclude_frozen=args.exclude_frozen,
        show_progress=not args.quiet,
    )
    for f in files:
        print(f)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .inspect import summary

    print(summary(args.checkpoint))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-strategy", description="ZeRO sharding for PyTorch.")
    parser.add_argument("--version", action="version", version=f"zero-strategy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)

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
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_consolidate)

    i = sub.add_parser(
        "inspect", help="summarize a checkpoint: world size, stage, sizes, completeness"
    )
    i.add_argument("checkpoint")
    i.set_defaults(func=_inspect)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:  # CheckpointError is a RuntimeError
        print(f"zero-strategy {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
