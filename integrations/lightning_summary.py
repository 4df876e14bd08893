"""Lightning's model summary with the full parameter counts of a stage-3 model.

Lightning counts `p.numel()`, which is 0 for a parameter stage 3 holds freed, so its table
would read "Total params: 0" (it special-cases DeepSpeed only). For a module sharded by a
ZeRO engine the counts come from the engine's layout instead; per-rank shard sizes are in
`engine.memory_report()`. The strategy routes its own trainer's summary callbacks here at
setup; Lightning's classes are not changed.
"""

from __future__ import annotations

import importlib

from zero_strategy import ZeroEngine

from .private_api import route_summary, summary_max_depth


def make_summary_class(root: str) -> type:
    """Lightning's `ModelSummary` (the utility) with its counts read from an engine: only
    its public count properties are overridden, so the table is Lightning's own."""
    base = importlib.import_module(f"{root}.utilities.model_summary.model_summary").ModelSummary

    class ZeroModelSummary(base):
        def __init__(self, model, engine: ZeroEngine, max_depth: int = 1):
            self.zero_engine, self.zero_model = engine, model  # before it summarises
            super().__init__(model, max_depth=max_depth)

        def zero_count(self, module, trainable: bool = False) -> int:
            return sum(
                self.zero_engine.parameter_numel(p)
                for p in module.parameters()
                if p.requires_grad or not trainable
            )

        @property
        def param_nums(self) -> list[int]:
            return [self.zero_count(self.zero_model.get_submodule(n)) for n in self.layer_names]

        @property
        def total_parameters(self) -> int:
            return self.zero_count(self.zero_model)

        @property
        def trainable_parameters(self) -> int:
            return self.zero_count(self.zero_model, trainable=True)

    return ZeroModelSummary


def count_with_engine(callbacks, engine: ZeroEngine, root: str) -> None:
    """The trainer's `ModelSummary` (and `RichModelSummary`) callbacks summarise through
    `engine` when it shards parameters (stage 3); at stages 0-2 they are Lightning's own.
    Only these callback objects change."""
    callback_cls = importlib.import_module(f"{root}.callbacks.model_summary").ModelSummary
    summary_cls = make_summary_class(root)
    for callback in callbacks:
        if not isinstance(callback, callback_cls):
            continue
        if engine.stage < 3:
            route_summary(callback, None)
            continue

        def summary(trainer, pl_module, callback=callback):
            return summary_cls(pl_module, engine, max_depth=summary_max_depth(callback))

        route_summary(callback, summary)
