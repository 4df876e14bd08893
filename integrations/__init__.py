"""Thin adapters of ZeroEngine for Lightning, Fabric, Accelerate and Hydra.

`import zero_strategy` makes "zero1".."zero3" valid strategy names (and Hydra config
entries `trainer/strategy=zero1..zero3`). Lightning's and
Fabric's registries are read when a Trainer or Fabric is built, and Lightning's launcher
re-runs the script, so registration must come with the import. It does, without making
`import zero_strategy` pay for importing Lightning: frameworks already imported are
registered at once, the others the moment their strategies module is first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable

_TARGETS: dict[str, Callable[[], None]] = {}


def _lightning(name: str) -> Callable[[], None]:
    def register() -> None:
        from .lightning import register as register_pl

        register_pl(name.rsplit(".", 1)[0])

    return register


def _fabric() -> None:
    from .fabric import register

    register()


def _hydra() -> None:
    from .hydra import register_configs

    register_configs()


_TARGETS["lightning.pytorch.strategies"] = _lightning("lightning.pytorch.strategies")
_TARGETS["pytorch_lightning.strategies"] = _lightning("pytorch_lightning.strategies")
_TARGETS["lightning.fabric.strategies"] = _fabric
_TARGETS["hydra.core.config_store"] = _hydra


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a target module so that our
    strategies are registered right after that module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _safely(_TARGETS[fullname], fullname)

        spec.loader.exec_module = exec_module
        return spec


def _safely(register: Callable[[], None], target: str) -> None:
    """A failed registration must never break the framework's own import."""
    try:
        register()
    except Exception as e:  # e.g. a framework version whose internals moved
        warnings.warn(
            f"zero-strategy could not register its strategies with {target}: {e!r}. "
            "Pass ZeroStrategy(...) instances instead of names.",
            stacklevel=2,
        )


def register_all() -> None:
    pending = False
    for name, register in _TARGETS.items():
        if name in sys.modules:
            _safely(register, name)
        else:
            pending = True
    if pending and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
