"""Thin adapters of ZeroEngine for Lightning, Fabric, Accelerate and Hydra."""
