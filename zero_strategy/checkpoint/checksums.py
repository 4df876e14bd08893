"""Checksums of checkpoint files: the CRC-32 of every 1 MiB chunk of every tensor,
computed at save from the bytes in memory (no second read) and verified by each load for
the chunks it reads, so that a flipped byte in a shard is an error rather than a silently
different model, and a load that reads a slice of a tensor verifies only that slice."""

from __future__ import annotations

import math
import zlib

import torch

from .safetensors_io import SafetensorsFile

CHUNK_BYTES = 1 << 20


class ChecksumMismatch(ValueError):
    pass


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def chunk_crcs(t: torch.Tensor) -> list[int]:
    data = _bytes(t)
    return [zlib.crc32(data[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)]


def verified_read(
    handle: SafetensorsFile, key: str, lo: int, hi: int, crcs: list[int], out: torch.Tensor
) -> torch.Tensor:
    """Elements [lo, hi) of `key` into `out` (hi - lo elements, any dtype), checking each
    chunk they touch: one chunk is read at a time, so the check costs at most one chunk
    of memory whatever the range."""
    per_chunk = CHUNK_BYTES // handle.dtype(key).itemsize
    numel = math.prod(handle.shape(key))
    for chunk in range(lo // per_chunk, (hi - 1) // per_chunk + 1 if hi > lo else 0):
        start, end = chunk * per_chunk, min((chunk + 1) * per_chunk, numel)
        data = handle.read_range(key, start, end)
        if chunk >= len(crcs) or zlib.crc32(_bytes(data)) != crcs[chunk]:
            raise ChecksumMismatch(
                f"tensor '{key}' fails its checksum in bytes "
                f"[{chunk * CHUNK_BYTES}:{chunk * CHUNK_BYTES + (end - start) * data.element_size()}]"
            )
        a, b = max(lo, start), min(hi, end)
        out[a - lo : b - lo].copy_(data[a - start : b - start])
    return out
