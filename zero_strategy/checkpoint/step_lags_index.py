"""The `step_lags` of a checkpoint's index, read as untrusted input.

Per param group, {parameter name: how many of the group's steps it missed}
(`optim/step_lag.py`). A parameter's own count is the group's less its lag, so a lag is
a whole number from 0 to the group's count: anything else is a corrupt index, refused
before anything is loaded or consolidated.
"""

from __future__ import annotations

from typing import Any

from .format import RESTORE
from .safe_load import CheckpointError


def checked_step_lags(optimizer_index: dict[str, Any]) -> list[dict[str, int]]:
    """The index's lags per param group (none for a checkpoint written before they were
    kept); raises CheckpointError for a malformed or impossible one."""
    groups = len(optimizer_index["param_groups"])
    lags = optimizer_index.get("step_lags")
    if lags is None:
        return [{} for _ in range(groups)]
    if not isinstance(lags, list) or len(lags) != groups:
        raise _corrupt(f"is not a list of one entry per param group ({groups})")
    scalars = optimizer_index.get("scalar_state") or [{} for _ in range(groups)]
    for g, (by_name, scalar) in enumerate(zip(lags, scalars)):
        if not isinstance(by_name, dict):
            raise _corrupt(f"holds {by_name!r} for param group {g}, not a dict")
        count = (scalar.get("step") or {}).get("value", 0)
        for name, lag in by_name.items():
            whole = isinstance(lag, int) and not isinstance(lag, bool)
            if not isinstance(name, str) or not whole or not 0 <= lag <= count:
                raise _corrupt(
                    f"gives {name!r} a lag of {lag!r} in param group {g}, whose step count "
                    f"is {count}: a lag is a whole number from 0 to the count"
                )
    return lags


def _corrupt(what: str) -> CheckpointError:
    return CheckpointError(f"The checkpoint's optimizer 'step_lags' {what}. {RESTORE}")
