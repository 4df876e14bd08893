"""One rank's file of offloaded tensors.

Space is handed out in 4 KiB-aligned blocks and reserved on disk when it is handed out
(`posix_fallocate`), so a disk too small fails at the allocation, naming the directory,
rather than half-way through a step. Reads and writes are positional (`pread`/`pwrite`),
straight between the file and a tensor's memory, with O_DIRECT where the file system
takes it: the state then bypasses the page cache, which would otherwise keep a second
copy of it in RAM. O_DIRECT needs aligned memory, offsets and lengths; `aligned_empty`
gives the memory, the allocator the offsets and lengths.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import warnings
from pathlib import Path

import torch

ALIGN = 4096


class OffloadError(OSError):
    """The offload directory cannot be used, or an I/O to it failed; the message names the
    directory and the fix."""


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` (rounded up to ALIGN), page-aligned: memory mapped
    for it alone, so that it goes back to the system when the tensor is dropped (the C
    allocator may keep freed blocks of this size in its heap, still resident)."""
    with warnings.catch_warnings():  # "non-writable buffer": an anonymous map is writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, round_up(max(nbytes, 1))), dtype=torch.uint8)


def check_directory(directory: str | os.PathLike | None, purpose: str) -> Path:
    """`directory` as a Path, or an error naming what is wrong with it and the fix."""
    if directory is None or str(directory) == "":
        raise OffloadError(
            f"{purpose} needs a directory: set ZeroConfig(offload_dir=...) to a directory on "
            "a local disk with room for this rank's offloaded state."
        )
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise OffloadError(
            f"offload_dir {path} does not exist or is not a directory; create it (mkdir -p) "
            "or point offload_dir at an existing directory on a local disk."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(
            f"offload_dir {path} is not writable by this process; fix its permissions or "
            "point offload_dir at a directory you can write."
        )
    return path


class OffloadFile:
    """A scratch file under `directory`, unlinked as soon as it is open."""

    def __init__(self, directory: Path, name: str):
        self.directory = directory
        self.path = directory / name
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise self._error("creating", e) from e
            self.direct = False  # tmpfs and some network file systems refuse O_DIRECT
            self._fd = os.open(self.path, flags, 0o600)
        # Unlinked at once: the file lives while this process holds it open, and its space
        # comes back when the process ends, however it ends (a crash, a kill -9).
        self.path.unlink()
        self.size = 0  # the file's extent handed out so far (holes included)
        self._holes: list[tuple[int, int]] = []  # (offset, bytes) given back, by offset
        self._scratch: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> int:
        """Reserve `nbytes` (rounded up to ALIGN): in the first hole a `release` left that
        is large enough, else at the end of the file. Its offset."""
        size = round_up(nbytes)
        for i, (at, free) in enumerate(self._holes):
            if free >= size:
                if free == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (at + size, free - size)
                return at
        offset = self.size
        try:
            if hasattr(os, "posix_fallocate"):  # not on macOS: the writes will tell there
                os.posix_fallocate(self._fd, offset, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # then the writes will tell
                raise self._error("reserving space in", e, size) from e
        self.size += size
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        """Give back a region `allocate` handed out, for a later one to reuse (its state
        was laid out again, larger). Neighbouring holes merge."""
        self._holes.append((offset, round_up(nbytes)))
        self._holes.sort()
        merged: list[tuple[int, int]] = []
        for at, free in self._holes:
            if merged and merged[-1][0] + merged[-1][1] == at:
                merged[-1] = (merged[-1][0], merged[-1][1] + free)
            else:
                merged.append((at, free))
        self._holes = merged

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Write `data` (contiguous uint8, ALIGN-aligned and sized under O_DIRECT) at
        `offset`."""
        view = memoryview(data.numpy())
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as e:
            raise self._error("writing", e, len(view)) from e

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill `out` (contiguous uint8, aligned as for `write`) from `offset`."""
        view = memoryview(out.numpy())
        done = 0
        try:
            while done < len(view):
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at {offset + done}")
                done += got
        except OSError as e:
            raise self._error("reading", e, len(view)) from e

    def read_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` from any `offset` (not necessarily aligned), as a new uint8 tensor:
        read through an aligned scratch buffer when O_DIRECT needs it."""
        if not self.direct:
            out = torch.empty(nbytes, dtype=torch.uint8)
            self.read(offset, out)
            return out
        start = offset - offset % ALIGN
        span = round_up(offset + nbytes - start)
        if self._scratch is None or self._scratch.numel() < span:
            self._scratch = aligned_empty(span)
        self.read(start, self._scratch[:span])
        return self._scratch[offset - start : offset - start + nbytes].clone()

    def reset(self) -> None:
        """Forget every allocation (the file keeps its size; space is handed out again)."""
        self.size = 0
        self._holes.clear()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _error(self, action: str, error: OSError, nbytes: int = 0) -> OffloadError:
        if error.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.directory).free
            fix = (
                f"no space left on the device of offload_dir {self.directory} ({free:,} bytes "
                f"free, {nbytes:,} needed now). Free space there or point offload_dir at a "
                "larger disk; checkpoints already written are not affected."
            )
        else:
            fix = (
                f"{error.strerror or error}. Check the disk behind offload_dir "
                f"{self.directory}, or point offload_dir elsewhere."
            )
        return OffloadError(error.errno, f"{action} {self.path} failed: {fix}")
