"""Generation that keeps ranks in step when every forward is a collective.

At stage 3 (parameter gathers) and under expert parallelism (token all-to-alls) each
forward needs every rank. Transformers' `generate()` stops a rank once its own sequences
are done, which would leave the others waiting for it, unless it runs with `synced_gpus`:
then finished ranks keep running forwards until all are done. Transformers turns that on
by itself for models it knows to be sharded, those marked `_is_fsdp_managed_module` (its
FSDP2 path sets it); models the engine shards get the same mark.
"""

from __future__ import annotations

from torch import nn

from ..private_api import mark_sharded_for_generate


def keep_generation_in_step(model: nn.Module) -> None:
    """Mark every Transformers model in `model` (a module with `generate` and a `config`)
    so that its `generate()` defaults to `synced_gpus=True` on more than one rank."""
    for module in model.modules():
        if callable(getattr(module, "generate", None)) and hasattr(module, "config"):
            mark_sharded_for_generate(module)
