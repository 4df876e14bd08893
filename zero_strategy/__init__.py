"""zero-strategy: ZeRO sharding (stages 1-3) for PyTorch.

`ZeroEngine` is the framework-free core; Lightning, Fabric and Accelerate adapters live in
`zero_strategy.integrations` and only wrap it.
"""

from . import private_api  # noqa: F401  (first: an older torch fails here, naming the fix)
from .builder.meta_init import init_on_meta
from .checkpoint.safe_load import CheckpointError
from .comm.communicator import PeerLostError
from .config import ZeroConfig, ZeroConfigError
from .deepspeed_config import from_deepspeed_config
from .engine import ZeroEngine
from .integrations.adapters import trainable_state_dict
from .layout.shard_spec import ShardSpec
from .optim.shard_views import UnsupportedOptimizerError
from .units.gather import ModulePathDivergenceError

__all__ = [
    "CheckpointError",
    "ModulePathDivergenceError",
    "PeerLostError",
    "ShardSpec",
    "UnsupportedOptimizerError",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "from_deepspeed_config",
    "init_on_meta",
    "trainable_state_dict",
]

__version__ = "0.1.0"


def _register_frameworks() -> None:
    """`import zero_strategy` makes "zero1".."zero3" valid Lightning/Fabric strategy names.
    The adapters import their framework only when it is installed; the core modules never
    import them (this package entry point is the one place that knows both)."""
    from .integrations import register_all

    register_all()


_register_frameworks()
