"""zero-strategy: ZeRO sharding (stages 1-3) for PyTorch.

`ZeroEngine` is the framework-free core; Lightning, Fabric and Accelerate adapters live in
`zero_strategy.integrations` and only wrap it.
"""

from .config import ZeroConfig, ZeroConfigError
from .engine import ZeroEngine
from .init import init_on_meta
from .optimizer import UnsupportedOptimizerError
from .params import ModulePathDivergenceError

__all__ = [
    "ModulePathDivergenceError",
    "UnsupportedOptimizerError",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "init_on_meta",
]

__version__ = "0.1.0"
