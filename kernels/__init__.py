"""Fused kernels (Triton on CUDA) with plain-torch reference paths."""
