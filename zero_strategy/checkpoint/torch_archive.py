"""A `torch.save` archive written without holding its tensors.

torch writes the archive's skeleton itself from fake tensors
(`torch.serialization.skip_data`): the pickle, and one record per storage whose bytes
are left as a hole (the file is sparse until they are written). Anyone may then write any
part of a record's data in place: one process streaming every tensor (consolidation), or
every rank its own ranges of the same file (a one-file checkpoint written in parallel).
The CRC-32 of each record is written last, from the CRCs of its parts, so the archive
stays valid for zip readers that check them (torch's own does not).
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_POLY = 0xEDB88320  # CRC-32's reflected polynomial (zlib's, zip's)


@dataclass(frozen=True)
class Record:
    """One storage's data in the archive: where its bytes start in the file, how many."""

    name: str  # the zip member ("<prefix>/data/<key>")
    offset: int
    size: int


def write_skeleton(obj: Any, path: Path) -> list[Record]:
    """`torch.save(obj, path)` with every storage's bytes left unwritten; the records of
    `tensors_in_pickle_order(obj)`, in that order."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
    prefix = next(iter(infos)).split("/")[0]
    records = []
    with open(path, "rb") as f:
        for key in range(len(tensors_in_pickle_order(obj))):
            info = infos[f"{prefix}/data/{key}"]
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            start = info.header_offset + 30 + name_len + extra_len
            records.append(Record(info.filename, start, info.file_size))
    return records


def tensors_in_pickle_order(obj: Any) -> list[torch.Tensor]:
    """Tensors with distinct storages, depth first in insertion order, as pickle meets
    them (torch numbers the storage records in this order)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            key = (
                id(x)
                if x.device.type == "meta" or type(x).__name__ == "FakeTensor"
                else x.untyped_storage().data_ptr()
            )
            if key not in seen:
                seen.add(key)
                out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset` of the open file `fd` (os.pwrite may write less)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def patch_crcs(path: Path, crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 (by member name) into its local header and its central
    directory entry, in one pass over the directory."""
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
        pos = z.start_dir
    with open(path, "r+b") as f:
        while True:
            f.seek(pos)
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                break
            n, m, k = struct.unpack("<HHH", head[28:34])
            name = f.read(n).decode()
            if name in crcs:
                packed = struct.pack("<I", crcs[name] & 0xFFFFFFFF)
                f.seek(pos + 16)
                f.write(packed)
                f.seek(infos[name].header_offset + 14)
                f.write(packed)
            pos += 46 + n + m + k
        f.flush()
        os.fsync(f.fileno())


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


@functools.cache
def _zero_bytes_operator(k: int) -> tuple[int, ...]:
    """The GF(2) matrix that carries a CRC over 2**k zero bytes (each the square of the
    one before; the first is the one-bit operator squared three times)."""
    if k == 0:
        matrix = [_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):
            matrix = _gf2_square(matrix)
        return tuple(matrix)
    return tuple(_gf2_square(list(_zero_bytes_operator(k - 1))))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from CRC(A), CRC(B) and len(B) (zlib's crc32_combine, which
    Python's zlib does not expose): parts written by different ranks make one record's."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def record_crc(parts: list[tuple[int, int, int]], record: Record) -> int:
    """A record's CRC from its written parts (start within the record, length, CRC), which
    must cover it exactly: a missing or overlapping part is an error, not a silent hole."""
    crc, end = 0, 0
    for start, length, part_crc in sorted(parts):
        if start != end:
            raise RuntimeError(
                f"{record.name}: bytes [{end}, {start}) of {record.size} were written by no "
                "rank, or twice"
            )
        crc = crc32_combine(crc, part_crc, length)
        end = start + length
    if end != record.size:
        raise RuntimeError(f"{record.name}: {end} of its {record.size} bytes were written")
    return crc
