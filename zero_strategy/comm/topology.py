"""Process groups: the groups each unit shards, reduces and gathers over.

The engine never uses the caller's default group for its own collectives: it creates
groups of its own, with the configured timeout, so that a peer that never joins raises
instead of hanging, and so that user collectives cannot interleave with ours.

- `CommGroup`: one process group and this rank's place in it.
- `ShardGroup`: one rank's view of a `ShardSpec`: the group it shards with (a
  communicator with its own byte accounting), the replica group that keeps the copies
  equal, and the world, over which gradients are averaged.
- `ProcessGroups`: creates each group once (group creation is collective: every rank
  asks for the same specs in the same order), destroys them all on `close()`, and
  re-creates them when a closed group is used again.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..layout.shard_spec import ShardSpec
from ..tensor_parallel import MeshLayout
from . import elastic_store
from .communicator import Communicator
from .two_level import TwoLevelExchange


def backend_for(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class CommGroup:
    """A process group and this rank's place in it (`group` is None for a single rank,
    and for a closed group)."""

    ranks: tuple[int, ...]  # global ranks, rising (torch numbers a group's ranks so)
    rank: int  # this rank's position in `ranks`
    group: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def closed(self) -> bool:
        return self.distributed and self.group is None


@dataclass
class ShardGroup:
    """How one rank takes part in sharding the units of one spec."""

    spec: ShardSpec
    comm: Communicator  # this rank's shard group
    replicas: Communicator | None  # same position in every copy; None with one copy
    world: Communicator  # every data-parallel rank
    copy_index: int  # which copy this rank's group holds
    # Stage 3's gathers and stage 2-3's reductions in two hops (node, then across nodes),
    # or quantized: the whole world's units only (None: the shard group's own collectives).
    exchange: TwoLevelExchange | None = None

    @property
    def rank(self) -> int:
        return self.comm.group.rank

    @property
    def size(self) -> int:
        return self.comm.group.size

    @property
    def primary(self) -> bool:
        """Whether this rank's shards count in the global norm and are written to
        checkpoints: each element once, so copy 0 of replicated copies, every distinct one."""
        return self.copy_index == 0 or not self.spec.replicated

    @property
    def summed_over_copies(self) -> Communicator | None:
        """Replicated copies: the group a shard's gradient is summed over after its own
        group's reduction (None when there is one copy, or the copies are distinct)."""
        return self.replicas if self.spec.replicated else None

    @property
    def holders(self) -> Communicator:
        """Every rank holding this rank's copy's parameters: a full gradient is summed, and
        initial values agree, over it (the world for replicated copies)."""
        return self.world if self.spec.replicated else self.comm

    @property
    def grad_divisor(self) -> int:
        """Every rank's loss is a mean over its own batch; the step follows their mean, so
        the summed gradient is divided by the number of data-parallel ranks."""
        return self.world.group.size


class ProcessGroups:
    """Every process group one engine uses: created on first request, destroyed by
    `close()` (the engine also closes when it is garbage-collected), re-created with the
    same ranks by `reopen()`."""

    def __init__(
        self,
        device: torch.device,
        timeout_s: float,
        reduce_scatter_via_all_reduce: bool | None,
        all_gather_via_broadcast: bool | None,
        mesh: MeshLayout | None = None,
        secondary_partition_size: int = 1,
        quantize_weights: bool = False,
        quantize_gradients: bool = False,
    ):
        """With tensor parallelism (`mesh`: the ranks as a (data, tensor) grid;
        `MeshLayout.of_world`), the engine's world is this rank's data-parallel world: the
        ranks at its tensor-parallel position. `rank`, `world_size` and every spec count
        in it; each position's groups are made alike. None: no tensor parallelism."""
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        # Creation order: (group, partition, backend).
        self._made: list[tuple[CommGroup, tuple[tuple[int, ...], ...], str]] = []
        self._order_tags: Communicator | None = None
        self._groups: dict[ShardSpec, ShardGroup] = {}
        if not dist.is_available() or not dist.is_initialized():
            self.backend, self.rank, self.world_size = "none", 0, 1
        else:
            self.backend = backend_for(device)
            # get_backend_config, not get_backend: a plain init_process_group() (torchrun's
            # usual call) reports "undefined" there but "cpu:gloo,cuda:nccl" here.
            default_backend = str(dist.get_backend_config()).lower()
            if self.backend == "nccl" and "nccl" not in default_backend:
                raise RuntimeError(
                    "Parameters are on CUDA but the default process group uses "
                    f"'{default_backend}'. Initialize it with backend='nccl' (or "
                    "'cpu:gloo,cuda:nccl')."
                )
            elastic_store.warn_if_restarts_share_a_store()
        self.mesh = mesh if mesh is not None else MeshLayout.of_world(None, 1)
        self.global_rank, self.global_world_size = self.mesh.global_rank, self.mesh.world_size
        self.rank, self.world_size = self.mesh.data_index, self.mesh.data_size
        if self.world_size % secondary_partition_size:  # before any group is made
            raise ValueError(
                f"secondary_partition_size={secondary_partition_size} does not divide the "
                f"data-parallel world of {self.world_size} ranks; set it to the ranks per "
                "node (torchrun's --nproc-per-node), a divisor of the world size."
            )
        on_gloo = self.backend == "gloo"
        # gloo's own reduce-scatter is slow: point-to-point sends move half the bytes of
        # an all-reduce, and are the default there.
        if reduce_scatter_via_all_reduce is None:
            self._reduce_scatter = "pairwise" if on_gloo else "native"
        else:
            self._reduce_scatter = "all_reduce" if reduce_scatter_via_all_reduce else "native"
        self._ag_via_bcast = (
            on_gloo if all_gather_via_broadcast is None else all_gather_via_broadcast
        )
        self._comms: dict[tuple[tuple[int, ...], ...], Communicator] = {}
        self._own_groups: list[Communicator] = []  # the two-hop exchange's
        self._default = _default_group()  # the world our groups were made in
        world_spec = ShardSpec.world(self.world_size)
        world = self.communicator(world_spec.groups)
        self.world = ShardGroup(world_spec, world, None, world, 0)
        self._groups[world_spec] = self.world
        if secondary_partition_size > 1 or quantize_weights or quantize_gradients:
            self.world.exchange = self._two_level(
                secondary_partition_size, quantize_weights, quantize_gradients
            )
        # Tensor parallelism: the ranks at the other positions (the gradient norm spans
        # them), and every rank (agreement on what the whole model does).
        tp = self.mesh.tensor_size > 1
        self.tensor = self._communicator(self.mesh.tensor_partition()) if tp else None
        self.everyone = self._communicator(self.mesh.everyone()) if tp else world

    def _two_level(
        self, per_node: int, quantize_weights: bool, quantize_gradients: bool
    ) -> TwoLevelExchange:
        """The world's two-hop exchange over nodes of `per_node` consecutive ranks."""
        nodes = ShardSpec.contiguous(self.world_size, per_node)
        hops = [
            self._new_communicator(self.mesh.expand(partition))
            for partition in (nodes.groups, nodes.replica_groups())
        ]
        self._own_groups.extend(hops)  # groups of its own: nothing interleaves with its hops
        return TwoLevelExchange(*hops, quantize_weights, quantize_gradients, self.device)

    # ------------------------------------------------------------------ groups
    def shard_group(self, spec: ShardSpec) -> ShardGroup:
        """This rank's `ShardGroup` for `spec` (collective the first time: every rank must
        ask for the same specs in the same order)."""
        if spec not in self._groups:
            copy, _ = spec.locate(self.rank)
            shard = self.communicator(spec.groups)
            replicas = self.communicator(spec.replica_groups()) if spec.copies > 1 else None
            self._groups[spec] = ShardGroup(spec, shard, replicas, self.world.comm, copy)
        return self._groups[spec]

    def communicator(self, partition: tuple[tuple[int, ...], ...]) -> Communicator:
        """The communicator of this rank's group in `partition` (the data-parallel ranks
        split into groups), created once (collective the first time, as `shard_group`)."""
        return self._communicator(self.mesh.expand(partition))

    def _communicator(self, partition: tuple[tuple[int, ...], ...]) -> Communicator:
        """The communicator of this rank's group in `partition` (global ranks)."""
        if partition not in self._comms:
            self._comms[partition] = self._new_communicator(partition)
        return self._comms[partition]

    def _new_communicator(self, partition: tuple[tuple[int, ...], ...]) -> Communicator:
        """A communicator over a new group of this rank in `partition` (global ranks)."""
        return Communicator(
            self._create(partition), self._reduce_scatter, self._ag_via_bcast, self.refresh
        )

    def _create(
        self, partition: tuple[tuple[int, ...], ...], backend: str | None = None
    ) -> CommGroup:
        """This rank's group of `partition` (every rank creates every group of it), on
        the engine's backend unless told another."""
        mine = next(g for g in partition if self.global_rank in g)
        comm_group = CommGroup(mine, mine.index(self.global_rank), None)
        if comm_group.distributed:
            backend = backend or self.backend
            comm_group.group = self._new_group(partition, backend)
            self._made.append((comm_group, partition, backend))
        return comm_group

    def _new_group(self, partition: tuple[tuple[int, ...], ...], backend: str) -> dist.ProcessGroup:
        try:
            return self._new_group_unchecked(partition, backend)
        except RuntimeError as e:
            raise elastic_store.explain_group_failure(e) from e

    def _new_group_unchecked(
        self, partition: tuple[tuple[int, ...], ...], backend: str
    ) -> dist.ProcessGroup:
        if len(partition) == 1:
            return dist.new_group(ranks=list(partition[0]), timeout=self.timeout, backend=backend)
        group, _ = dist.new_subgroups_by_enumeration(
            [list(g) for g in partition], timeout=self.timeout, backend=backend
        )
        return group

    def order_tags(self) -> Communicator:
        """A group over this rank's data-parallel world that carries only stage 3's
        module-order tags (so they only ever pair with each other), on gloo whatever the
        device: the tags are CPU integers, read without waiting for a device. Per
        tensor-parallel position, as the gathers are (positions may gather differently)."""
        if self._order_tags is None:
            self._order_tags = Communicator(
                self._create(self.mesh.expand(self.world.spec.groups), "gloo"),
                "native",
                False,
                self.refresh,
            )
        return self._order_tags

    def communicators(self) -> list[Communicator]:
        """Every communicator, each once."""
        extra = [self._order_tags] if self._order_tags is not None else []
        return [*self._comms.values(), *self._own_groups, *extra]

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per collective kind since the last `reset_comm_report()`,
        summed over every communicator; with the bytes this rank received from ranks of
        its own node and of others (`comm/nodes.py`)."""
        total: dict[str, dict[str, int]] = {}
        for comm in self.communicators():
            for kind, counts in comm.report().items():
                entry = total.setdefault(kind, dict.fromkeys(counts, 0))
                for key, value in counts.items():
                    entry[key] += value
        return dict(sorted(total.items()))

    def reset_comm_report(self) -> None:
        for comm in self.communicators():
            comm.reset()

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return any(g.closed for g, _, _ in self._made)

    def refresh(self) -> None:
        """Before each collective: follow a default group that was destroyed and created
        again (every group of the old one died with it), and re-create closed groups."""
        if self.backend != "none" and _default_group() is not self._default:
            self._follow_new_default_group()
        if self.closed:
            self.reopen()

    def _follow_new_default_group(self) -> None:
        current = _default_group()
        if current is None:
            raise RuntimeError(
                "The default process group was destroyed while this engine still uses it. "
                "Call torch.distributed.init_process_group() again (same world size) before "
                "using the engine, or close() it first."
            )
        if dist.get_world_size() != self.global_world_size or dist.get_rank() != self.global_rank:
            raise RuntimeError(
                f"The default process group was re-created with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}; this engine was built as rank {self.global_rank} "
                f"of {self.global_world_size}. Build a new engine (or load its checkpoint) "
                "for a new "
                "world."
            )
        for comm_group, _, _ in self._made:
            comm_group.group = None  # destroyed with the old default group; not ours to free
        self._default = current

    def close(self) -> None:
        """Destroy the groups this object created; the next collective on any of them
        re-creates them all (`reopen`). Local (no collective) and idempotent, so it is safe
        at teardown and from a finalizer. Callers first finish their own work in flight."""
        if self.world.exchange is not None:
            self.world.exchange.close()
        live = [g for g, _, _ in self._made if g.group is not None]
        if not live:
            return
        handles = [g.group for g in live]
        for g in live:
            g.group = None
        gc.collect()  # finished work objects that still hold a group let go of it first
        if _default_group() is not self._default:
            return  # the default group was destroyed, and every group with it
        for handle in handles:
            with contextlib.suppress(ValueError):  # destroyed already (a new default group)
                dist.destroy_process_group(handle)

    def reopen(self) -> None:
        """Re-create every closed group with the same ranks (collective: every rank calls
        it, in the same order as the groups were first made)."""
        for comm_group, partition, backend in self._made:
            if comm_group.group is None:
                comm_group.group = self._new_group(partition, backend)


def _default_group() -> dist.ProcessGroup | None:
    """The current default process group (None when there is none)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
