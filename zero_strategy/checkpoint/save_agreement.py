"""The failures of a save, agreed by every rank.

A save is collective: a rank that raised alone (a full disk, an I/O error, a client state
that cannot be stored) would leave the others waiting in the save's next collective until
the timeout, then reporting a lost peer. Each step that can fail here returns its failure
as a message instead; the ranks exchange them, and every rank raises the first one.
"""

from __future__ import annotations

import errno
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from . import atomic_dir
from .safetensors_io import LazyTensor
from .safetensors_io import save_streaming as save_file  # the name tests patch


class SaveFailed(RuntimeError):
    """One step of a save failed on this rank (the message says what and the fix)."""


def attempt(step: Callable[[], None], directory: Path, final: Path) -> str | None:
    """Run `step`; its failure as a message (None when it succeeded)."""
    try:
        step()
    except Exception as e:
        return failure_message(e, directory, final)
    return None


def failure_message(error: Exception, directory: Path, final: Path) -> str:
    """What failed while writing into `directory`, and that `final` is untouched.
    safetensors reports an OS error as its own exception whose text carries the errno."""
    text = str(error)
    out_of_space = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (
        "No space left" in text or "code: 28" in text
    )
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror
    cause = f"no space left on the device of {directory}: {text}" if out_of_space else text
    storage = out_of_space or isinstance(error, (OSError, SaveFailed))
    fix = "Free space or save elsewhere; the" if storage else "The"
    return (
        f"writing {directory} failed ({type(error).__name__}: {cause}). {fix} previous "
        f"checkpoint at {final} is intact."
    )


def file_bytes(tensors: dict[str, torch.Tensor | LazyTensor]) -> int:
    """A safetensors file's size, with a generous bound on its JSON header."""
    header = 8 + 128 * (len(tensors) + 1)
    return header + sum(
        t.nbytes if isinstance(t, LazyTensor) else t.numel() * t.element_size()
        for t in tensors.values()
    )


def write_rank_file(
    tensors: dict[str, torch.Tensor | LazyTensor], target: Path, needed_here: int
) -> None:
    """Write and fsync one rank's file, refusing first when the ranks of this host need
    more than the file system has free (`needed_here` bytes between them)."""
    free = shutil.disk_usage(target.parent).free
    if needed_here > free:
        raise OSError(
            errno.ENOSPC,
            f"this host's ranks need {needed_here:,} bytes and {free:,} are free; this "
            f"rank's file needs {file_bytes(tensors):,}",
        )
    try:
        save_file(tensors, target)
    except Exception as e:
        raise SaveFailed(f"{e}; this rank's file needs {file_bytes(tensors):,} bytes") from e
    atomic_dir.fsync_file(target)


def client_state_bytes(client_state: dict | None) -> bytes | None:
    """The client state serialized, refused now (on every rank, before anything is
    written) when a load could not read it back with weights_only=True."""
    if client_state is None:
        return None
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    check_safe_load(lambda: torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    return buffer.getvalue()


def check_safe_load(load: Callable[[], object]) -> None:
    """Run `load` (a torch.load with weights_only=True of what a save wrote); refused,
    naming what a safe load takes, when it cannot read it back."""
    try:
        load()
    except Exception as e:
        cause = (str(e).splitlines() or [type(e).__name__])[0]  # EOFError() says nothing
        raise ValueError(
            f"the client state holds objects that a safe load (weights_only=True) refuses: "
            f"{cause}. Keep only tensors, numbers, strings, lists and dicts in it"
        ) from e
