"""Runs one of Accelerate's multi-process test scripts, one result per call in its main().

Launched by run.py as `torchrun --nproc_per_node 2 accelerate_shim.py SCRIPT RESULTS_DIR
[REGEX]`; checks whose name does not match REGEX are reported skipped, not run.
The script's `main()` calls a series of checks and stops at the first failure; here each
function that `main()` calls by name is wrapped so that a failure is recorded (with its
first error line) and the rest still run, giving a per-check count. Each rank appends
`{"id", "event", ...}` lines to RESULTS_DIR/rank<N>.jsonl as it starts and ends a check,
so a check that hangs is the one started and never ended. The swap is the pytest
plugin's (`swap_plugin.install("accelerate")`); the state is set up for CPU processes as
`accelerate launch --cpu` does, and the default process-group timeout is cut to 2 minutes so that a rank left alone in a collective fails instead of waiting 30.
"""

from __future__ import annotations

import ast
import datetime
import functools
import importlib.util
import inspect
import json
import os
import re
import sys
import traceback
from pathlib import Path

import swap_plugin
import torch.distributed


def _short_timeout() -> None:
    init = torch.distributed.init_process_group

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        limit = datetime.timedelta(minutes=2)
        if kwargs.get("timeout") is None or kwargs["timeout"] > limit:
            kwargs["timeout"] = limit
        return init(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group


def _called_by_main(source: str) -> list[str]:
    tree = ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return [
        node.func.id
        for node in ast.walk(main)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]


def main() -> None:
    script, results = Path(sys.argv[1]), Path(sys.argv[2])
    only = sys.argv[3] if len(sys.argv) > 3 else ""  # selection.txt's `~ REGEX`
    rank = os.environ.get("RANK", "0")
    out = open(results / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    swap_plugin.install("accelerate")
    _short_timeout()
    if os.environ.get("ACCELERATE_USE_CPU"):
        # `accelerate launch --cpu` reaches PartialState through Accelerator; test_ops.py
        # builds a bare PartialState(), which would otherwise see one process on CPU.
        from accelerate import PartialState

        PartialState(cpu=True)

    spec = importlib.util.spec_from_file_location(f"maintainer_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    depth = [0]
    calls: dict[str, int] = {}

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if depth[0]:  # called from another check: no record of its own
                return fn(*args, **kwargs)
            calls[name] = calls.get(name, 0) + 1
            test_id = f"scripts/{script.name}::{name}" + (
                f"#{calls[name]}" if calls[name] > 1 else ""
            )
            if not re.search(only, name):
                out.write(json.dumps({"id": test_id, "event": "skipped"}) + "\n")
                return None
            os.environ["ZERO_SWAP_TEST_ID"] = test_id
            out.write(json.dumps({"id": test_id, "event": "start"}) + "\n")
            depth[0] += 1
            result = None
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                lines = traceback.format_exception_only(type(e), e)
                message = lines[-1].strip() if lines else repr(e)
                out.write(json.dumps({"id": test_id, "event": "failed", "message": message}) + "\n")
                traceback.print_exc()
            else:
                out.write(json.dumps({"id": test_id, "event": "passed"}) + "\n")
            finally:
                depth[0] -= 1
                os.environ.pop("ZERO_SWAP_TEST_ID", None)
            return result

        return recorded

    for name in dict.fromkeys(_called_by_main(script.read_text())):
        fn = getattr(module, name, None)
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and name != "main":
            setattr(module, name, wrap(name, fn))
    os.environ["ZERO_SWAP_TEST_ID"] = f"scripts/{script.name}::main"
    module.main()
    out.write(json.dumps({"id": f"scripts/{script.name}::main", "event": "end"}) + "\n")


if __name__ == "__main__":
    try:
        main()
    finally:  # a gloo group alive at interpreter exit can abort the process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
