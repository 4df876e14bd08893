"""Read element ranges of tensors in safetensors files with plain reads, no mmap; write
files one tensor at a time.

safetensors' own `safe_open` maps the file: every page a reader touches then counts in its
resident memory until the file is closed, so streaming through a checkpoint would grow
RSS to the checkpoint's size. The format is a little-endian u64 header length, a JSON
header of {name: {dtype, shape, data_offsets}}, then the data: reading a range is one
seek and one readinto() into the destination tensor.

Writing (`save_streaming`) lays the header out from each tensor's dtype and shape, then
writes the tensors in order, asking for each (`LazyTensor.load`) only when its turn
comes: a rank whose optimizer state lives on disk never holds more than one tensor of it,
where `safetensors.torch.save_file` needs every tensor in memory at once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to be written, produced only when the writer reaches it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def lazy(tensor: torch.Tensor) -> LazyTensor:
    return LazyTensor(tensor.dtype, tuple(tensor.shape), lambda: tensor)


def save_streaming(
    tensors: Mapping[str, torch.Tensor | LazyTensor], target: str | os.PathLike
) -> None:
    """Write a safetensors file of `tensors` (in this order), one at a time."""
    entries = {k: v if isinstance(v, LazyTensor) else lazy(v) for k, v in tensors.items()}
    header: dict[str, dict] = {}
    at = 0
    for name, entry in entries.items():
        header[name] = {
            "dtype": CODES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [at, at + entry.nbytes],
        }
        at += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, entry in entries.items():
            value = entry.load().detach()
            if value.dtype != entry.dtype or tuple(value.shape) != entry.shape:
                raise ValueError(
                    f"'{name}' was announced as {entry.dtype} {entry.shape} and produced "
                    f"{value.dtype} {tuple(value.shape)}"
                )
            if value.numel():
                data = value.cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))


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
