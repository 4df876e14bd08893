"""pytest plugin: applies selection.txt's per-file name filters and records each outcome.

A failing test's first error line is what the report prints, so it is taken here, where
the whole report is at hand: for a failure inside a spawned worker the pytest message is
only `ProcessRaisedException` / `ProcessExitedException`, and the worker's own exception
is further down, or only in the captured stderr, or escaped inside another message.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

_EXCEPTION = re.compile(
    r"^E\s+((?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt|Failed|Timeout)\b.*)"
)
_WORKER = re.compile(r"^((?:[\w.]+\.)?\w*(?:Error|Exception|Failed)\w*:.*)$")
_ESCAPED = re.compile(r"\\n((?:[\w.]+\.)?\w*(?:Error|Exception|Failed)\w*: .*?)(?=\\n|(?<!\\)'|$)")
_RANK = os.environ.get("LOCAL_RANK", "0")  # a re-launched standalone worker has 1


def worker_error(report: Any) -> str | None:
    """The last exception line a spawned worker wrote (captured stderr), else the last one
    escaped inside the message (`Actual message: '...Traceback...\\nValueError: ...'`)."""
    for name, content in reversed(report.sections):
        if "stderr" in name:
            found = [m.group(1) for line in content.splitlines() if (m := _WORKER.match(line))]
            if found:
                return found[-1]
    escaped = _ESCAPED.findall(report.longreprtext)
    return escaped[-1] if escaped else None


def first_error_line(text: str) -> str:
    """The innermost exception line of a pytest report (else its first `E` line), with
    the two `E` lines after it when they explain it ("Regex pattern did not match." /
    "Expected regex: ..." / "Actual message: ...")."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    starts = [i for i, line in enumerate(lines) if _EXCEPTION.match("E " + line)]
    if not lines:
        return text.strip().splitlines()[-1] if text.strip() else ""
    first = starts[-1] if starts else 0
    tail = [line for line in lines[first + 1 : first + 3] if line and not line.startswith("File ")]
    return " / ".join([lines[first], *tail])


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    filters = json.loads(os.environ.get("ZERO_SWAP_FILTERS", "{}"))
    if not filters:
        return
    keep, drop = [], []
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        name = item.nodeid.split("::")[-1]
        pattern = filters.get(path)
        (keep if pattern is None or re.search(pattern, name) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collectreport(report: Any) -> None:
    if report.failed:  # a test module that cannot be imported counts as one error
        _write(
            {
                "id": report.nodeid,
                "when": "collect",
                "outcome": "failed",
                "rank": _RANK,
                "message": first_error_line(report.longreprtext),
            }
        )


def _write(record: dict) -> None:
    path = os.environ.get("ZERO_SWAP_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: Any) -> None:
    record = {"id": report.nodeid, "when": report.when, "outcome": report.outcome, "rank": _RANK}
    record["standalone"] = os.environ.get("PL_RUN_STANDALONE_TESTS") == "1"
    if hasattr(report, "wasxfail"):
        record["xfail"] = True
    if report.skipped and isinstance(report.longrepr, tuple):
        record["message"] = str(report.longrepr[2])
    elif report.failed:
        record["message"] = first_error_line(report.longreprtext)
        if "Process" in record["message"] and (worker := worker_error(report)):
            record["message"] = f"{worker} (in a worker; {record['message']})"
    if report.when == "call" or report.outcome != "passed":
        record["duration"] = round(report.duration, 2)
    _write(record)
