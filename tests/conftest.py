import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Without a GPU the Triton kernels are tested under Triton's interpreter. Triton decides
# interpreted-or-compiled when each @triton.jit function (its own library included) is
# defined, so the switch must be on before anything imports triton (Lightning and
# transformers may, through torch's compiler stack).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _threads() -> list[str]:
    """The names of this (the pytest) process's threads."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return sorted(names)


def _gloo_threads() -> list[str]:
    """The threads of a gloo process group alive in this process."""
    return [name for name in _threads() if "gloo" in name]


if Path("/proc/self/task").is_dir():
    import pytest

    @pytest.fixture(autouse=True)
    def _no_process_group_left_in_the_test_process(request):
        """Ranks are forked from this process (tests/distributed.py): a process group
        created here and still alive (a DeviceMesh cache keeps one after
        destroy_process_group) is inherited by every later rank without its threads,
        and a rank that frees it waits forever for them (seen as hangs at the start or
        end of a rank's function, in other tests). Such a test fails here, by name."""
        before, all_before = _gloo_threads(), _threads()
        yield
        left = _gloo_threads()
        log = os.environ.get("ZERO_TEST_THREAD_LOG")  # which tests start threads here
        if log and len(_threads()) > len(all_before):
            with open(log, "a") as f:
                f.write(f"{request.node.nodeid}: {all_before} -> {_threads()}\n")
        if len(left) > len(before):
            pytest.fail(
                f"This test left a gloo process group alive in the pytest process "
                f"(threads {left}); forked ranks of later tests inherit it and can hang. "
                "Create process groups inside a rank (run_world) instead."
            )
