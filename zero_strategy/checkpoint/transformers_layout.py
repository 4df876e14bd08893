"""Pretrained weights in Transformers' checkpoint layout, read by the model's names.

Transformers 5 models often differ from their checkpoints: Mixtral's checkpoints hold one
`w1`/`w2`/`w3` matrix per expert where the model holds 3-D `gate_up_proj`/`down_proj`,
and modules are renamed (`block_sparse_moe` -> `mlp`). `from_pretrained` converts with
the model's own conversion mapping (`transformers.conversion_mapping`); so does this view,
with two differences that matter to a sharded engine:

- it reads only what is asked for: a range of a converted expert weight builds only the
  experts that range covers (an expert-parallel rank never reads the others);
- the conversions that act expert by expert (`MergeModulelist(dim=0)`, then `Concatenate`
  along a later dimension) are read so; any other (a fused QKV chunked into three, a
  kernel transposed, several tensors concatenated into one) builds its model tensors from
  its whole checkpoint tensors, by the model's own operations, one group at a time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .safetensors_io import SafetensorsFile


@dataclass
class _Whole:
    """Model tensors built together from whole checkpoint tensors by one converter that
    does not act expert by expert."""

    converter: object
    layer_name: str  # the first target's name, as Transformers names the group
    keys: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> keys


@dataclass
class _Converted:
    """One model tensor built from per-expert checkpoint tensors."""

    operations: list
    source_patterns: list[str]
    target_patterns: list[str]
    # source pattern -> expert id -> checkpoint key
    keys: dict[str, dict[int, str]] = field(default_factory=dict)


class TransformersLayout:
    """`keys()`, `shape(name)`, `read_range(name, lo, hi)`, `read(name)` by the model's
    names over checkpoint files (`open_file(key)` gives the file holding a checkpoint key)."""

    def __init__(
        self,
        model: nn.Module,
        checkpoint_keys: list[str],
        open_file: Callable[[str], SafetensorsFile],
    ):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        names = {n: True for n, _ in model.named_parameters(remove_duplicate=False)}
        names.update({n: True for n, _ in model.named_buffers()})
        prefix = getattr(model, "base_model_prefix", None)
        self._model = model
        self._open = open_file
        self._plain: dict[str, str] = {}  # model name -> checkpoint key
        self._converted: dict[str, _Converted] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # converted tensors' shapes
        groups: dict[tuple[int, str], _Whole] = {}
        for key in checkpoint_keys:
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in names and key in names:  # renamed by a rule for others, as
                target, pattern = key, None  # `from_pretrained` takes it (DeepSeek-V4's norm)
            if pattern is None:
                self._plain[target] = key
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            if not _acts_expert_by_expert(converter):
                group = groups.setdefault((id(converter), target), _Whole(converter, target))
                group.keys.setdefault(pattern, []).append(key)
                continue
            entry = self._converted.setdefault(
                target,
                _Converted(
                    converter.operations,
                    list(converter.source_patterns),
                    list(converter.target_patterns),
                ),
            )
            entry.keys.setdefault(pattern, {})[_expert_id(key, pattern)] = key
        for target, entry in self._converted.items():
            _check_expertwise(target, entry)
        self._whole: dict[str, _Whole] = {}  # model name -> the group building it
        for group in groups.values():
            for name in _target_names(group):
                self._whole[name] = group
        self._built: tuple[_Whole | None, dict[str, torch.Tensor]] = (None, {})

    def keys(self) -> list[str]:
        return [*self._plain, *self._converted, *self._whole]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._plain:
            return self._open(self._plain[name]).shape(self._plain[name])
        if name in self._whole:  # the model's own: nothing read for it
            try:
                return tuple(self._model.get_parameter(name).shape)
            except AttributeError:
                return tuple(self._model.get_buffer(name).shape)
        if name not in self._shapes:  # one expert built once, not at every read
            entry = self._converted[name]
            experts = len(next(iter(entry.keys.values())))
            self._shapes[name] = (experts, *self._build(entry, 0, 1).shape[1:])
        return self._shapes[name]

    def read_range(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened model tensor `name`."""
        if name in self._plain:
            return self._open(self._plain[name]).read_range(self._plain[name], lo, hi)
        if name in self._whole:
            return self._build_whole(self._whole[name])[name].reshape(-1)[lo:hi]
        shape = self.shape(name)
        per_expert = math.prod(shape[1:])
        first, last = lo // per_expert, max(lo, hi - 1) // per_expert
        rows = self._build(self._converted[name], first, last + 1).reshape(-1)
        return rows[lo - first * per_expert : hi - first * per_expert]

    def read(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.read_range(name, 0, math.prod(shape)).view(shape)

    def _build_whole(self, group: _Whole) -> dict[str, torch.Tensor]:
        """The group's model tensors, by the model's own operations over its whole
        checkpoint tensors; the last group built is kept (its tensors are read range by
        range, one after another)."""
        if self._built[0] is group:
            return self._built[1]
        converter = group.converter
        tensors = {
            pattern: [self._open(key).read(key) for key in keys]
            for pattern, keys in group.keys.items()
        }
        for op in converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns,
                full_layer_name=group.layer_name,
                model=self._model,
                config=getattr(self._model, "config", None),
            )
        prefix, suffix = _around(group)
        built = {prefix + pattern + suffix: value for pattern, value in tensors.items()}
        self._built = (group, built)
        return built

    def _build(self, entry: _Converted, first: int, end: int) -> torch.Tensor:
        """Experts [first, end) of a converted tensor, by the model's own operations."""
        tensors = {
            pattern: [
                self._open(entry.keys[pattern][e]).read(entry.keys[pattern][e])
                for e in range(first, end)
            ]
            for pattern in entry.source_patterns
        }
        for op in entry.operations:
            tensors = op.convert(
                tensors,
                source_patterns=entry.source_patterns,
                target_patterns=entry.target_patterns,
            )
        (value,) = tensors.values()
        return value


def _acts_expert_by_expert(converter) -> bool:
    from transformers.core_model_loading import MergeModulelist

    ops = converter.operations
    return bool(ops) and isinstance(ops[0], MergeModulelist)


def _around(group: _Whole) -> tuple[str, str]:
    """What comes before and after the target pattern in the group's name (Transformers
    names every target of a converter so)."""
    name = group.layer_name.replace("*.", "0.")
    for pattern in group.converter.target_patterns:
        if pattern in name:
            prefix, _, suffix = name.partition(pattern)
            return prefix, suffix
    raise ValueError(
        f"Cannot name the tensors built for '{group.layer_name}' from this checkpoint "
        f"(targets {group.converter.target_patterns}). Load the model once with "
        "from_pretrained and save its state_dict as safetensors to get the model's own "
        "layout, which loads directly."
    )


def _target_names(group: _Whole) -> list[str]:
    prefix, suffix = _around(group)
    return [prefix + pattern + suffix for pattern in group.converter.target_patterns]


def _expert_id(key: str, pattern: str) -> int:
    """The number the pattern's `*` stands for in `key`. Transformers' patterns are
    regular expressions (`\\.experts.*.w1.weight`) or plain names (`experts.*.w1`)."""
    found = None
    for regex in (pattern.replace("*", r"(\d+)"), re.escape(pattern).replace(r"\*", r"(\d+)")):
        try:
            found = re.search(regex, key)
        except re.error:
            continue
        if found is not None and found.groups():
            break
    if found is None or not found.groups():
        raise ValueError(f"Cannot tell which expert checkpoint tensor '{key}' holds ({pattern}).")
    return int(found.group(1))


def _check_expertwise(target: str, entry: _Converted) -> None:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = entry.operations
    merge_first = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    rest_ok = all(isinstance(op, Concatenate) and op.dim >= 1 for op in ops[1:])
    ids = [sorted(by_id) for by_id in entry.keys.values()]
    complete = all(i == list(range(len(ids[0]))) for i in ids) and len(ids) == len(
        entry.source_patterns
    )
    if not (merge_first and rest_ok and complete):
        raise ValueError(
            f"Cannot read '{target}' from this checkpoint piece by piece: it is built by "
            f"{[type(op).__name__ for op in ops]} from {entry.source_patterns} (experts "
            f"{ids}). Load the model once with from_pretrained and save its state_dict "
            "as safetensors (or consolidate a zero-strategy checkpoint) to get the model's "
            "own layout, which loads directly."
        )
