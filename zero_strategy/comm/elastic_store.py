"""torchrun restarts, and the store its workers share.

Since torch 2.5 torchrun hands its workers its own rendezvous store, which outlives a
restart. The attempt after a failure then creates its process groups under the same keys
as the failed one, and a rank can read an address the dead attempt published: the group
fails with "Connection refused" (pytorch/pytorch#135712, #167288). Giving torchrun
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes each attempt create a store of its own. The
engine creates several groups, so it meets this on every restart; it says so up front.
"""

from __future__ import annotations

import os
import warnings

FIX = (
    "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, so "
    "that each attempt gets a store of its own"
)


def restarts_share_a_store() -> bool:
    """Whether this worker runs under torchrun with restarts and the shared store."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def warn_if_restarts_share_a_store() -> None:
    if restarts_share_a_store():
        warnings.warn(
            "torchrun may restart this job (--max-restarts) and shares its rendezvous store "
            "with the workers: after a restart, creating the engine's process groups can "
            f"read the failed attempt's addresses and fail (pytorch#167288). {FIX}.",
            stacklevel=4,
        )


def explain_group_failure(error: Exception) -> Exception:
    """A group creation that failed in a restarted attempt over the shared store, as an
    error that names the cause and the fix; any other error unchanged."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if not (restarted and restarts_share_a_store() and "connect" in str(error).lower()):
        return error
    return RuntimeError(
        f"Creating the engine's process groups failed in torchrun's restart "
        f"{os.environ['TORCHELASTIC_RESTART_COUNT']}: {str(error).splitlines()[0][:200]}. "
        "torchrun shares one rendezvous store across restarts and this attempt read an "
        f"address the failed attempt left there (pytorch#167288). {FIX}."
    )
