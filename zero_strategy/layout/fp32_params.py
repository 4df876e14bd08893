"""Parameters that compute in fp32 while the rest of the model computes in bf16 or fp16.

Some weights lose too much in half precision: an MoE router's top-k picks flip on the
rounding of its weights, an attention sink or a score-correction bias drifts.
Transformers marks them on the model class (`_keep_in_fp32_modules_strict` for bf16 and
fp16, `_keep_in_fp32_modules` for fp16 alone) and loads them in fp32; FSDP2 users give
such modules a mixed-precision policy of their own; DeepSpeed casts them with the rest.
PEFT keeps its adapters in fp32 over a half-precision base likewise. Here their units
(stage 3) or buckets (stages 0-2) are fp32 ones: the forward sees them as loaded, and no
half-precision copy rounds them. Their masters are fp32 anyway.

The patterns are Transformers' own: searched (not matched whole) in each parameter name,
`*` standing for any run of characters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..config import pattern_regex

HALF_DTYPES = (torch.bfloat16, torch.float16)


def fp32_patterns(
    model: nn.Module, configured: Sequence[str] | None, compute_dtype: torch.dtype | None
) -> list[tuple[str, list[str]]]:
    """The patterns in force, each with the path of the module whose parameters they
    search: none unless the compute dtype is half; the configured ones over the whole
    model; else every module's marks over its own parameters, as Transformers applies
    them at that dtype (a Transformers model inside a LightningModule, a teacher beside
    a student), and PEFT's adapters, as PEFT keeps them."""
    if compute_dtype not in HALF_DTYPES:
        return []
    if configured is not None:
        return [("", list(configured))] if configured else []
    scoped = []
    for path, module in model.named_modules():
        marks = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if compute_dtype == torch.float16:
            marks |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        if marks:
            scoped.append((path, sorted(marks)))
        adapters = _fp32_adapters(module)
        if adapters:  # PEFT's, over this layer's own parameters
            names = "|".join(re.escape(name) for name in adapters)
            scoped.append((path, [rf"^({names})(\.|$)"]))
    return scoped


def _fp32_adapters(module: nn.Module) -> list[str]:
    """A PEFT tuner layer's adapters whose weights are fp32, each as its sublayer and
    adapter name (LoRA's `lora_A.default`). PEFT makes an adapter in its base layer's
    dtype, casts it to fp32 over a bf16 or fp16 base (`get_peft_model`'s
    `autocast_adapter_dtype`, on by default), and computes its path in its own dtype; an
    adapter left in half precision (`autocast_adapter_dtype=False`) computes in the
    compute dtype with the rest, and one on an fp32 layer (a kept router) in fp32."""
    names = getattr(module, "adapter_layer_names", ())
    if not isinstance(names, tuple):
        return []
    found = []
    for layer_name in names:
        per_adapter = getattr(module, layer_name, None) if isinstance(layer_name, str) else None
        if not isinstance(per_adapter, (nn.ModuleDict, nn.ParameterDict)):
            continue
        for adapter_name, held in per_adapter.items():
            tensors = [held] if isinstance(held, torch.Tensor) else list(held.parameters())
            if any(t.dtype == torch.float32 for t in tensors):
                found.append(f"{layer_name}.{adapter_name}")
    return found


class Fp32Parameters:
    """Which parameters compute in fp32: one any of whose names (a tied parameter has
    several) matches a pattern of a module that holds it."""

    def __init__(self, scoped: Sequence[tuple[str, Sequence[str]]] = ()):
        self.scoped = [(path, list(patterns)) for path, patterns in scoped]
        self._regexes = [(path, pattern_regex(patterns)) for path, patterns in self.scoped]
        # The layout asks about each parameter several times (a pass per kind of bucket).
        self._answers: dict[tuple[str, ...], bool] = {}

    def __bool__(self) -> bool:
        return bool(self._regexes)

    def __call__(self, names: Iterable[str]) -> bool:
        key = tuple(names)
        if key not in self._answers:
            self._answers[key] = any(
                self._matches(name, path, regex) for name in key for path, regex in self._regexes
            )
        return self._answers[key]

    @staticmethod
    def _matches(name: str, path: str, regex: re.Pattern | None) -> bool:
        """`name` (under `path`) matches, as the model names it: a layer PEFT wrapped
        holds its weight as `<layer>.base_layer.weight`, where the mark says
        `<layer>.weight`."""
        if regex is None or (path and not name.startswith(path + ".")):
            return False
        local = name[len(path) + 1 :] if path else name
        unwrapped = local.replace(".base_layer.", ".")
        return regex.search(local) is not None or regex.search(unwrapped) is not None

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The patterns that match none of `names` (a configured one is a mistake)."""
        names = list(names)
        alone = [(path, p, pattern_regex([p])) for path, patterns in self.scoped for p in patterns]
        return [
            p for path, p, regex in alone if not any(self._matches(n, path, regex) for n in names)
        ]
