"""Lightning: where the ZeRO strategy puts the model, its data and its mesh.

Never the whole model on the device: the engine copies each unit's parameters there as it
shards them, so `trainer.init_module()` and `configure_model()` build on the meta device
or in CPU memory, and the strategy moves only the buffers. With tensor parallelism the
(data_parallel, tensor_parallel) mesh is the one Lightning's `ModelParallelStrategy`
gives, under its names, and the sampler splits the data over the data-parallel ranks. A
mixin of the ZeRO strategy class: `super()` is Lightning's `DDPStrategy`.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Iterator
from typing import Any

import torch

from zero_strategy import ZeroConfig, init_on_meta
from zero_strategy.comm.shutdown import destroy_default_group_at_exit
from zero_strategy.tensor_parallel import tensor_parallel_mesh

from .devices import place_buffers, require_cpu_or_cuda
from .private_api import give_device_mesh


class DevicePlacement(ABC):  # (as Strategy: the layout a DDPStrategy can change class to)
    _zero_base: ZeroConfig
    _device_mesh: Any
    _true_dtype: torch.dtype | None

    def setup_environment(self) -> None:
        require_cpu_or_cuda(self.root_device, "Trainer")
        super().setup_environment()
        destroy_default_group_at_exit()  # a gloo group alive at exit can abort
        # Tensor parallelism: the mesh ModelParallelStrategy gives, under its names, so
        # that a configure_model() written for it applies its plan here unchanged.
        self._device_mesh = tensor_parallel_mesh(
            self._zero_base.tensor_parallel_size, self.world_size, self.root_device
        )
        if self._device_mesh is not None:
            give_device_mesh(self.lightning_module, self._device_mesh)

    @property
    def device_mesh(self):
        """The (data_parallel, tensor_parallel) mesh, with tensor_parallel_size > 1."""
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Tensor-parallel ranks read the same batches: the sampler splits the data over
        the data-parallel ranks only."""
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs
        data = self._device_mesh["data_parallel"]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}

    def model_to_device(self) -> None:
        """Buffers only: the engine copies each unit's parameters onto the device as it
        shards them, so the whole model never sits on one device at once."""
        kept = self._zero_base.fp32_parameters
        place_buffers(self.model, self.root_device, self._true_dtype, kept)

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """`trainer.init_module()`, as Lightning's FSDP strategy: with empty_init=True
        on the meta device (the engine materialises each rank's shard), otherwise in
        CPU memory; never the whole model on the device, as the DDP base would."""
        meta = init_on_meta() if empty_init else contextlib.nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """configure_model() runs here: modules are built on the meta device (a
        tensor-parallel plan applied there too) and the engine materializes only this
        rank's shard, one unit at a time."""
        with init_on_meta():
            yield
