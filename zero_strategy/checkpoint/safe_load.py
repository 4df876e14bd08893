"""Reading torch files that came from elsewhere, without running them.

A `.pt`/`.ckpt` file is a pickle: loading it as such can run any code its author put in.
Everything this project reads back (a checkpoint's client state, a consolidated `.ckpt`)
goes through `safe_torch_load`, which uses torch's weights-only unpickler and turns its
refusal into a `CheckpointError` that names the file.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, hostile or of another model."""


def safe_torch_load(path: str | os.PathLike, mmap: bool = False) -> Any:
    """A torch file read with weights_only=True: a pickle that would run code or build
    arbitrary objects is refused, naming the file, and never executed. `mmap`: tensors
    are mapped from the file, read as they are touched."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects that safe loading (weights_only=True) refuses, so it was "
            f"not executed: {str(e).splitlines()[0]}. Save only tensors, numbers, strings, "
            "lists and dicts in it, or load it yourself if you trust its author."
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(
            f"{path} is not a readable torch file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Restore it, or load an earlier one."
        ) from e
