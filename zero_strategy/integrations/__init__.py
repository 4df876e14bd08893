"""Thin adapters of ZeroEngine for Lightning, Fabric, Accelerate and Hydra.

`import zero_strategy` makes "zero1".."zero3" valid strategy names (and Hydra config
entries `trainer/strategy=zero1..zero3`). Lightning's and Fabric's registries are read
when a Trainer or Fabric is built, and Lightning's launcher re-runs the script, so
registration must come with the import; Lightning 2.6 and Fabric read no entry points
for strategies, and importing them eagerly would cost every `import zero_strategy`
seconds. So frameworks already imported are registered at once, and the others the
moment their strategies module is first imported, by an import hook that only wraps those
modules' loaders and leaves `sys.meta_path` once every installed framework is registered.
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
    own = sys.modules.get(f"{__name__}.fabric")
    if own is not None and not hasattr(own, "register"):
        return  # our fabric module is importing Fabric: it registers at its own end
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
            _leave_when_done()

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


def _installed(target: str) -> bool:
    """Whether the framework of `target` is installed (found without importing it)."""
    return importlib.util.find_spec(target.split(".")[0]) is not None


def _pending() -> list[str]:
    return [name for name in _TARGETS if name not in sys.modules and _installed(name)]


def _leave_when_done() -> None:
    """Every installed framework is registered: the hook has nothing left to do."""
    if not _pending():
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]


def register_all() -> None:
    for name, register in _TARGETS.items():
        if name in sys.modules:
            _safely(register, name)
    if _pending() and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
