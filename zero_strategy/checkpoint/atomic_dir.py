"""Publishing a directory in one step, so that a reader sees the old one or the new one
and never a mix, whenever the writer is killed.

A save writes into `<name>.tmp`, then `publish` swaps it into place. On Linux the swap is
one `renameat2(RENAME_EXCHANGE)`: the new directory takes the name and the old one takes
`<name>.tmp`, to be deleted. Where that call is missing (another OS, a file system that
refuses it) the swap is two renames through `<name>.old`; a kill between them leaves no
`<name>` but a complete `<name>.old`, which `resolve` reads and the next save clears.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import warnings
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def previous_dir(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the platform cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"Cannot swap {a} into place of {b}: {os.strerror(code)}")


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable. Platforms that cannot
    open or fsync a directory skip it; a failing fsync is an error."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(final: Path) -> Path:
    """An empty staging directory for `final`, clearing what an interrupted save left (a
    stale staging directory, or the previous directory once `final` exists again)."""
    tmp = staging_dir(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    old = previous_dir(final)
    if old.exists() and final.exists():
        shutil.rmtree(old)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, final: Path, swap: bool = True) -> None:
    """Put the complete directory `tmp` at `final` and delete what was there (deleting
    is best-effort: once the new directory is in place, the save has succeeded)."""
    fsync_dir(tmp)
    if swap and final.exists() and _exchange(tmp, final):
        _settle(final)
        shutil.rmtree(tmp, ignore_errors=True)  # the previous directory, now here
        return
    old = previous_dir(final)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        if old.exists() and not final.exists():
            old.rename(final)  # the previous checkpoint back at its name
        raise
    _settle(final)
    shutil.rmtree(old, ignore_errors=True)


def _settle(final: Path) -> None:
    """Make the rename durable. It has happened: a failure here is a warning, not a
    failed save."""
    try:
        fsync_dir(final.parent)
    except OSError as e:
        warnings.warn(
            f"{final} is in place, but syncing its directory failed ({e}): after a power "
            "loss the previous checkpoint may be back. Check the file system.",
            stacklevel=3,
        )


def resolve(final: Path) -> Path:
    """`final`, or the previous directory when a two-rename publish was killed between
    its renames (then `final` is missing and `<name>.old` is whole)."""
    old = previous_dir(final)
    if not final.exists() and old.is_dir():
        return old
    return final
