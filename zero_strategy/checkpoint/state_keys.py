"""Where an optimizer's elementwise state is stored in a checkpoint: "<key>/<name>", or
for a later optimizer's state of a parameter that an earlier one steps too (SGD and Adam
over the same weights) "<key>@group<g>/<name>", so that each optimizer's state of it
is kept and resumed."""

from __future__ import annotations

_LATER_GROUP = "@group"


def state_key(key: str, group: int, first_group: int) -> str:
    """The stored name of state `key` of param group `group` for a parameter whose first
    group is `first_group`: the key itself, or for a later optimizer's group over the
    same parameter the key marked with that group."""
    return key if group == first_group else f"{key}{_LATER_GROUP}{group}"


def keys_of_group(keys: list[str], group: int, first_group: int) -> list[tuple[str, str]]:
    """(stored key, optimizer state key) of `keys` that belong to `group`'s state of a
    parameter whose first group is `first_group`."""
    if group == first_group:
        return [(k, k) for k in keys if _LATER_GROUP not in k]
    mark = f"{_LATER_GROUP}{group}"
    return [(k, k.removesuffix(mark)) for k in keys if k.endswith(mark)]
