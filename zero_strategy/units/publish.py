"""Stages 1-2: after the optimizer step, every rank's updated shard is all-gathered back
into the full parameters, over each unit's shard group. The gathers are launched at once,
last-used unit last, and a module waits only for the units holding its parameters, in a
forward pre-hook: the communication overlaps the next forward instead of lengthening the
step (as FSDP's unsharding in pre-forward does).

The waits sit on the blocks (the modules stage 3 would make units: the children of every
`nn.ModuleList`, or `unit_module_classes`), each waiting for every unit under it, and on
the modules outside any block that own parameters. None sits inside a block, so a block
compiled with `torch.compile` is one graph, and a model compiled whole breaks only between
blocks, as at stage 3. `engine.backward()`, `step()` and `full_state_dict()` wait for
whatever is still in flight, which covers parameters used outside their own module's
forward by the time anything could depend on them.
"""

from __future__ import annotations

from torch import nn

from ..layout.shard_spec import within
from .flat_unit import FlatUnit
from .module_hooks import EngineHook


class ParameterPublisher:
    def __init__(self, model: nn.Module, units: list[FlatUnit], overlap: bool, blocks: list[str]):
        self.units = units
        self.overlap = overlap
        self.pending: dict[int, object] = {}
        unit_of_param = {id(p): u.layout.index for u in units for p in u.params}
        self.handles = []
        if not overlap:
            return
        for path, module in model.named_modules():
            if any(path != block and within(path, block) for block in blocks):
                continue  # its block waits for it
            mine = sorted(
                {
                    unit_of_param[id(p)]
                    for p in module.parameters(recurse=path in blocks)
                    if id(p) in unit_of_param
                }
            )
            if mine:
                self.handles.append(
                    module.register_forward_pre_hook(EngineHook(self._make_hook(mine)))
                )

    def _make_hook(self, indices: list[int]):
        def hook(module, args):
            self.wait(indices)

        return hook

    def launch(self) -> None:
        """Start gathering every unit's updated shard (first-used units first)."""
        for unit in reversed(self.units):
            if unit.layout.numel:
                self.pending[unit.layout.index] = unit.start_publish()
        if not self.overlap:
            self.wait_all()

    def wait(self, indices: list[int]) -> None:
        for idx in indices:
            work = self.pending.pop(idx, None)
            if work is not None:
                work.wait()

    def wait_all(self) -> None:
        self.wait(list(self.pending))

    def drop(self) -> None:
        """Let go of the gathers in flight without waiting (a peer is gone, or the
        process is ending after an error)."""
        self.pending.clear()
