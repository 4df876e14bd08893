"""Lightning's model summary with the full parameter counts of a stage-3 model.

Lightning counts `p.numel()`, which is 0 for a parameter stage 3 holds freed, so its table
would read "Total params: 0" (it special-cases DeepSpeed only). For a module sharded by a
ZeRO engine the counts come from the engine's layout instead; per-rank shard sizes are in
`engine.memory_report()`.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict

from zero_strategy import ZeroEngine


def make_summary_classes(root: str):
    summary_module = importlib.import_module(f"{root}.utilities.model_summary.model_summary")
    LayerSummary, ModelSummary = summary_module.LayerSummary, summary_module.ModelSummary

    class ZeroLayerSummary(LayerSummary):
        def __init__(self, module, engine):
            super().__init__(module)
            self._engine = engine

        @property
        def num_parameters(self) -> int:
            return sum(self._engine.parameter_numel(p) for p in self._module.parameters())

    class ZeroModelSummary(ModelSummary):
        def __init__(self, model, engine, max_depth: int = 1):
            self._engine = engine  # before super().__init__, which summarizes
            super().__init__(model, max_depth=max_depth)

        def summarize(self):
            summary = OrderedDict(
                (name, ZeroLayerSummary(module, self._engine))
                for name, module in self.named_modules
            )
            if self._model.example_input_array is not None:
                self._forward_example_input()
            for layer in summary.values():
                layer.detach_hook()
            if self._max_depth >= 1:
                for key in [k for k in summary if k.count(".") >= self._max_depth]:
                    del summary[key]
            return summary

        @property
        def total_parameters(self) -> int:
            return sum(self._engine.parameter_numel(p) for p in self._model.parameters())

        @property
        def trainable_parameters(self) -> int:
            return sum(
                self._engine.parameter_numel(p) for p in self._model.parameters() if p.requires_grad
            )

    return ZeroModelSummary


def patch_model_summary_callback(root: str) -> None:
    """Route `ModelSummary` (and `RichModelSummary`) to the engine-aware summary when the
    trainer's strategy is a ZeRO strategy at stage 3; every other strategy is untouched."""
    callback_cls = importlib.import_module(f"{root}.callbacks.model_summary").ModelSummary
    if getattr(callback_cls, "_zero_strategy_wrapped", False):
        return
    original = callback_cls._summary
    summary_cls: list[type] = []

    def _summary(self, trainer, pl_module):
        engine = getattr(trainer.strategy, "engine", None)
        if not isinstance(engine, ZeroEngine) or engine.stage < 3:
            return original(self, trainer, pl_module)
        if not summary_cls:
            summary_cls.append(make_summary_classes(root))
        return summary_cls[0](pl_module, engine, max_depth=self._max_depth)

    callback_cls._summary = _summary
    callback_cls._zero_strategy_wrapped = True
