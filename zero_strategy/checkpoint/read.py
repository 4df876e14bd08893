"""Reading a sharded checkpoint by ranges: each rank opens only the rank files that hold
what its new shard needs, checking every chunk it reads against the index's checksums."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ..tensor_parallel import TensorPlacement, read_block
from .checksums import CHUNK_BYTES, ChecksumMismatch, verified_read
from .format import (
    CLIENT_STATE,
    INDEX,
    MASTER_DTYPES,
    RESTORE,
    located,
    rank_file,
    read_index,
    stored_blocks,
)
from .safe_load import CheckpointError, safe_torch_load
from .safetensors_io import SafetensorsFile


# ============================================================================ loading
def client_state_in(folder: Path) -> dict | None:
    """The client state saved in a checkpoint directory (loaded with weights_only=True),
    or None."""
    client = folder / CLIENT_STATE
    return safe_torch_load(client) if client.exists() else None


class CheckpointReader:
    """Reads ranges of parameters and state from a checkpoint directory, opening each
    rank file once and only when a range in it is needed."""

    def __init__(self, path: str | os.PathLike):
        self.path = located(path)
        self.index = read_index(self.path)
        self.optimizer_error: str | None = None  # (a one-file reader's may say why)
        self._files: dict[str, Any] = {}
        # A tensor-parallel block assembled from another layout's blocks, by what it is.
        self._block_key: tuple | None = None
        self._block: torch.Tensor | None = None

    def client_state(self) -> dict | None:
        """The client state saved with the checkpoint (weights_only), or None."""
        return client_state_in(self.path)

    def _open(self, rank: int) -> SafetensorsFile:
        name = rank_file(rank)
        if name not in self._files:
            try:
                self._files[name] = SafetensorsFile(self.path / name)
            except Exception as e:
                raise CheckpointError(
                    f"Cannot read {self.path / name}: {e}. The file is truncated or corrupt; "
                    "restore it or load an earlier checkpoint."
                ) from e
        return self._files[name]

    def read(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str = "",
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        layout: TensorPlacement | None = None,
    ) -> torch.Tensor:
        """Elements [lo, hi) of flattened parameter `name` (or its `prefix` state) in
        `dtype`, read straight into the result (no mmap, no intermediate copy when the
        stored dtype is the same); into `out` (a contiguous tensor of hi - lo elements)
        when given. Masters are stored fp32, or fp64 by fp64 training.

        `layout`: the reader's tensor-parallel placement of the parameter (None: whole),
        in whose stored coordinates [lo, hi) is; a checkpoint written with another one
        is translated (its overlapping blocks read, `TensorPlacement`)."""
        sources = stored_blocks(self.index["params"][name])
        wanted = None if layout is None or not layout.sharded else layout
        if (wanted.blocks() if wanted else None) != sources:
            return self._translated(name, lo, hi, prefix, out, dtype, wanted, sources)
        return self._read_stored(name, lo, hi, prefix, out, dtype)

    def _translated(self, name, lo, hi, prefix, out, dtype, wanted, sources) -> torch.Tensor:
        """[lo, hi) of this reader's block of `name`, assembled from the stored blocks
        (kept for the next range of the same block)."""
        shape = tuple(self.index["params"][name]["shape"])
        target = wanted.block(wanted.position) if wanted else ((0,) * len(shape), shape)
        key = (name, prefix, target, dtype)
        if self._block_key != key:
            self._block_key, self._block = None, None  # the previous one goes first
            stored = sources or [((0,) * len(shape), shape)]
            offsets = [0]
            for _, block_shape in stored:
                offsets.append(offsets[-1] + math.prod(block_shape))
            self._block = read_block(
                target,
                stored,
                lambda k: self._read_stored(name, offsets[k], offsets[k + 1], prefix, None, dtype),
                dtype,
            ).reshape(-1)
            self._block_key = key
        at = wanted.offset if wanted else 0
        values = self._block[lo - at : hi - at]
        if out is None:
            return values.clone()
        out.copy_(values)
        return out

    def _read_stored(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str,
        out: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        entry = self.index["params"][name]
        if out is None:
            out = torch.empty(hi - lo, dtype=dtype)
        elif out.dtype not in MASTER_DTYPES or out.numel() != hi - lo or not out.is_contiguous():
            raise ValueError(
                f"read(out=...) needs a contiguous fp32 or fp64 tensor of {hi - lo} elements."
            )
        filled = 0
        for piece in entry["pieces"]:
            a, b = max(lo, piece["start"]), min(hi, piece["end"])
            if a >= b:
                continue
            key = f"{prefix}{name}"
            handle = self._open(piece["rank"])
            if key not in handle.tensors or handle.dtype(key) not in MASTER_DTYPES:
                raise CheckpointError(
                    f"{rank_file(piece['rank'])} in {self.path} lacks fp32 '{key}' that "
                    f"{INDEX} says it holds; the index does not match the files. {RESTORE}"
                )
            target = out[a - lo : b - lo]
            crcs = self._crcs(piece["rank"], key)
            try:
                if crcs is not None:
                    verified_read(handle, key, a - piece["start"], b - piece["start"], crcs, target)
                elif handle.dtype(key) == out.dtype:
                    handle.read_range(key, a - piece["start"], b - piece["start"], target)
                else:
                    target.copy_(handle.read_range(key, a - piece["start"], b - piece["start"]))
            except ChecksumMismatch as e:
                raise self._corrupt(piece["rank"], e) from e
            except ValueError as e:
                raise CheckpointError(f"{e}; the index does not match the files. {RESTORE}") from e
            filled += b - a
        if filled != hi - lo:
            raise CheckpointError(
                f"{INDEX} in {self.path} covers {filled} of the {hi - lo} elements [{lo}:{hi}] "
                f"of '{name}': the index does not match the files. {RESTORE}"
            )
        return out

    def holds(self, name: str, prefix: str) -> bool:
        """Whether any rank file holds `prefix` state of `name` (an Adam parameter has no
        "momentum_buffer/", an SGD one no "exp_avg/", when two optimizers were saved)."""
        return any(
            f"{prefix}{name}" in self._open(piece["rank"]).tensors
            for piece in self.index["params"][name]["pieces"]
        )

    def verify(
        self,
        name: str,
        lo: int,
        hi: int,
        prefix: str = "",
        dtype: torch.dtype = torch.float32,
        layout: TensorPlacement | None = None,
    ) -> None:
        """Read and check [lo, hi) as `read` would, a bounded piece at a time, keeping
        nothing: a load verifies all it will read before it changes the model."""
        if layout is not None and layout.sharded:  # read as it will be, block by block
            self.read(name, lo, hi, prefix, dtype=dtype, layout=layout)
            return
        if stored_blocks(self.index["params"][name]):  # whole, from blocks
            self.read(name, lo, hi, prefix, dtype=dtype)
            return
        step = 16 * CHUNK_BYTES // 4  # elements per read: 16 MiB of fp32
        scratch = torch.empty(min(step, max(hi - lo, 0)), dtype=dtype)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            self.read(name, a, b, prefix, out=scratch[: b - a], dtype=dtype)

    def buffer(self, name: str) -> torch.Tensor:
        key, handle = f"buffer/{name}", self._open(0)
        crcs = self._crcs(0, key)
        if crcs is None:  # a checkpoint from before checksums
            return handle.read(key)
        shape = handle.shape(key)
        out = torch.empty(math.prod(shape), dtype=handle.dtype(key))
        try:
            return verified_read(handle, key, 0, out.numel(), crcs, out).view(shape)
        except ChecksumMismatch as e:
            raise self._corrupt(0, e) from e

    def _crcs(self, rank: int, key: str) -> list[int] | None:
        checksums = self.index.get("checksums")
        if checksums is None:  # a checkpoint from before checksums
            return None
        if checksums.get("chunk_bytes") != CHUNK_BYTES:
            raise CheckpointError(
                f"{self.path / INDEX} records checksums of {checksums.get('chunk_bytes')}-byte "
                f"chunks; this version verifies {CHUNK_BYTES}-byte ones. Load it with the "
                "zero-strategy version that wrote it."
            )
        crcs = checksums["crc32"].get(rank_file(rank), {}).get(key)
        if crcs is None:
            raise CheckpointError(
                f"{self.path / INDEX} records no checksum for '{key}' in {rank_file(rank)}; "
                f"the index does not match the files. {RESTORE}"
            )
        return crcs

    def _corrupt(self, rank: int, error: ChecksumMismatch) -> CheckpointError:
        return CheckpointError(
            f"{self.path / rank_file(rank)}: {error}. The file is corrupt; restore it or load "
            "an earlier checkpoint."
        )
