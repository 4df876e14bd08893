"""Mixture of experts: `MoE` layers, expert-parallel and sharded by ZeRO at every stage."""

from .batched import BatchedMLP
from .layer import MoE, moe_losses
from .router import Router

__all__ = ["BatchedMLP", "MoE", "Router", "moe_losses"]
