"""`zero-strategy` command line. Subcommands arrive with their features (consolidate,
inspect, estimate); `env` reports what this machine offers the engine."""

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-strategy", description="ZeRO sharding for PyTorch.")
    parser.add_argument("--version", action="version", version=f"zero-strategy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
