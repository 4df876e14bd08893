"""Small real file systems for the full-disk tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def mount_small_tmpfs(mount: Path, size: str) -> bool:
    """Mount a tmpfs of `size` at `mount` where this process may (root); whether it did."""
    mount.mkdir(exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    return subprocess.run(command, capture_output=True).returncode == 0


def unmount(mount: Path) -> None:
    subprocess.run(["umount", str(mount)], check=True)
