"""Read element ranges of tensors in safetensors files with plain reads, no mmap.

safetensors' own `safe_open` maps the file: every page a reader touches then counts in its
resident memory until the file is closed, so streaming through a checkpoint would grow
RSS to the checkpoint's size. The format is a little-endian u64 header length, a JSON
header of {name: {dtype, shape, data_offsets}}, then the data: reading a range is one
seek and one readinto() into the destination tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = open(self.path, "rb")  # noqa: SIM115 (kept open for many reads)
        size = os.fstat(self._f.fileno()).st_size
        raw = self._f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{self.path} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{self.path}: header of {n} bytes exceeds the file ({size} bytes)")
        header = json.loads(self._f.read(n))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.tensors: dict[str, dict] = header
        end = max((m["data_offsets"][1] for m in header.values()), default=0)
        if self.base + end > size:
            raise ValueError(
                f"{self.path} is truncated: its data ends at {size} bytes, "
                f"the header needs {self.base + end}"
            )

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self.tensors[key]["dtype"]]

    def read_range(
        self, key: str, lo: int, hi: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor `key`, in its stored dtype (into
        `out` when given: a contiguous 1-D CPU tensor of that dtype and size)."""
        meta = self.tensors[key]
        dtype = DTYPES[meta["dtype"]]
        numel = math.prod(meta["shape"])
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"{self.path}: range [{lo}:{hi}] outside '{key}' of {numel} elements")
        if out is None:
            out = torch.empty(hi - lo, dtype=dtype)
        size = out.element_size()
        self._f.seek(self.base + meta["data_offsets"][0] + lo * size)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if hi > lo else memoryview(b"")
        if self._f.readinto(view) != (hi - lo) * size:
            raise ValueError(f"{self.path}: short read of '{key}' [{lo}:{hi}]")
        return out

    def read(self, key: str) -> torch.Tensor:
        return self.read_range(key, 0, math.prod(self.shape(key))).view(self.shape(key))

    def close(self) -> None:
        self._f.close()
