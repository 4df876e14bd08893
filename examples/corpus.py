"""A text corpus that needs no download: the docstrings of Python's standard library,
tokenised as bytes (vocabulary 256)."""

from __future__ import annotations

import importlib
import inspect

import torch

MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "http.client",
    "inspect",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)


def stdlib_text() -> str:
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc:
                parts.append(doc)
    return "\n\n".join(parts)


def byte_tokens() -> torch.Tensor:
    return torch.frombuffer(bytearray(stdlib_text().encode("utf-8")), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, block: int, step: int, seed: int = 0):
    """The same global batch for a given step on every rank; each rank slices its part."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(tokens) - block - 1, (batch,), generator=g)
    data = torch.stack([tokens[s : s + block + 1] for s in starts.tolist()])
    return data[:, :-1], data[:, 1:]
