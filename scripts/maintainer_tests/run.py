"""Runs Lightning's and Accelerate's own DDP tests with zero-strategy in DDP's place.

    .venv/bin/python scripts/maintainer_tests/run.py [--strategies ddp zero1 zero2 zero3]
        [--suite lightning|accelerate|all]

Our strategies claim to be drop-in replacements for DDP; the maintainers' DDP tests are
the most independent check of that claim. For each strategy the tests listed in
selection.txt run against the installed Lightning/Accelerate (sources: sources.py): "ddp"
runs them unchanged, as the baseline, and "zeroN" with `ZERO_SWAP_STAGE=N`, which makes
swap_plugin.py resolve every DDP name, `DDPStrategy` instance and `Accelerator` to the ZeRO
one. The report (benchmarks/results/maintainer_tests_<date>.md) has passed / failed /
errors / skipped per strategy, the tests that pass under ddp but not under a ZeRO stage
with their first error line, and the tests in expected_non_ddp.txt that no strategy but
DDP can pass. Raw results are kept under the cache, so a later run of only zero stages
still compares against the last ddp baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import rule
import sources

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEPS = sources.CACHE / "deps"  # test-only requirements, outside the project's venv
# module -> requirement: what the selected tests import that the project's venv lacks,
# installed with --no-deps (nothing there may shadow the venv's own packages)
EXTRA_DEPS = {
    "parameterized": "parameterized",  # Accelerate's tests
    "cloudpickle": "cloudpickle",  # Lightning's trainer/callback/checkpoint tests
    "sklearn": "scikit-learn",  # Lightning's ClassifDataModule (RunIf(sklearn=True))
    "scipy": "scipy",
    "joblib": "joblib",
    "threadpoolctl": "threadpoolctl",
    "narwhals": "narwhals",
    "tensorboardX": "tensorboardX",  # the default logger of Lightning's run_model_test
    "google.protobuf": "protobuf",
    # The maintainers' own `flaky(reruns=3)` marks (Lightning's spike-detection tests,
    # the spawn launcher's): their CI runs them with this plugin; without it a flake
    # fails at once, under every strategy alike. A failed try is recorded as "rerun".
    "pytest_rerunfailures": "pytest-rerunfailures",
    # Accelerate's test_distributed_data_loop (its StatefulDataLoader checks)
    "torchdata": "torchdata",
}
STAGES = {"ddp": None, "zero1": 1, "zero2": 2, "zero3": 3}
# The same stages with Lightning's and Fabric's strategies built with
# state_dict_type="full" (one checkpoint file, as DDP writes), instead of the default
# sharded directory: what a DDP user who sets it gets.
STAGES.update({f"{name}-full": stage for name, stage in list(STAGES.items()) if stage})
OUTCOMES = ("passed", "failed", "error", "skipped")
ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b:?.*)$")


def _command() -> str:
    return shlex.join([sys.executable.replace(str(REPO) + "/", ""), *sys.argv])


@dataclass
class Entry:
    kind: str  # "pytest", "standalone" or "script"
    target: str
    pattern: str | None = None


@dataclass
class Result:
    id: str
    outcome: str
    message: str = ""
    exercised: bool = False  # built the strategy under test (a ZeRO one, or DDP for "ddp")
    duration: float = 0.0


@dataclass
class SuiteRun:
    suite: str
    strategy: str
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0
    notes: list[str] = field(default_factory=list)
    command: str = field(default_factory=_command)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for r in self.results:
            counts[r.outcome] += 1
        return counts


def read_selection(path: Path) -> dict[str, list[Entry]]:
    suites: dict[str, list[Entry]] = defaultdict(list)
    suite = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            suite = line[1:-1]
            continue
        kind = "pytest"
        first, _, rest = line.partition(" ")
        if first in ("standalone", "script"):
            kind, line = first, rest.strip()
        target, _, pattern = (part.strip() for part in line.partition("~"))
        suites[suite].append(Entry(kind, target, pattern or None))
    return suites


def read_expected(path: Path) -> list[tuple[str, str]]:
    """(id pattern, reason) pairs: tests no non-DDP strategy can pass."""
    expected = []
    for raw in path.read_text().splitlines():
        if raw.strip() and not raw.lstrip().startswith("#"):
            pattern, _, reason = raw.partition("|")
            expected.append((pattern.strip(), reason.strip()))
    return expected


def read_limits(path: Path) -> dict[str, list[tuple[str, str]]]:
    """known_limits.txt: strategy -> [(test-id pattern, reason)]."""
    limits: dict[str, list[tuple[str, str]]] = defaultdict(list)
    if path.exists():
        for raw in path.read_text().splitlines():
            if raw.strip() and not raw.lstrip().startswith("#"):
                strategies, pattern, reason = (part.strip() for part in raw.split("|", 2))
                for strategy in strategies.split(","):
                    limits[strategy.strip()].append((pattern, reason))
    return limits


def expected_reason(test_id: str, expected: list[tuple[str, str]]) -> str | None:
    """The reason of the first pattern matching `test_id`; `*` is the only wildcard (test
    ids are full of brackets, which fnmatch would read as character sets)."""
    for pattern, reason in expected:
        if re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), test_id):
            return reason
    return None


# ------------------------------------------------------------------ processes
def _environment(strategy: str, suite: str, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_SWAP", "ZERO_STRATEGY"))}
    env.pop("PL_RUN_STANDALONE_TESTS", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), str(DEPS), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        ZERO_SWAP_SUITE=suite,
        ZERO_SWAP_MARKS=str(work / "marks.tsv"),
        ZERO_SWAP_REPORT=str(work / "report.jsonl"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if STAGES[strategy] is not None:
        env["ZERO_SWAP_STAGE"] = str(STAGES[strategy])
    if strategy.endswith("-full"):
        env["ZERO_SWAP_STATE_DICT_TYPE"] = "full"
    return env


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float, log: Path) -> int | None:
    """Runs `cmd` in its own session, killing whatever of it is left at the end (spawned
    workers of a timed-out test). None when it ran past `timeout`."""
    with open(log, "a") as out:
        out.write(f"\n$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _parametrizations(nodes: list[str], cwd: Path, rootdir: Path, env: dict, work: Path):
    """Each parametrization of the standalone tests `nodes`, to run in a pytest of its own as
    Lightning's run_standalone_tests.sh does. Run together, the parametrizations of one
    function launch their rank-1 processes afresh in each case (Lightning's test fixtures
    restore the environment the launcher marks itself in), and those run every case from
    the first, pairing with rank 0's later cases. A node that cannot be collected is kept
    whole, so that its error is reported."""
    if not nodes:
        return []
    log = work / "collect.log"
    cmd = [*_pytest_cmd(nodes, rootdir, 60), "--collect-only"]
    _run(cmd, cwd, env, 600, log)
    collected = [line.strip() for line in log.read_text().splitlines() if "::" in line]
    collected = [line for line in collected if not line.startswith("$ ")]
    expanded = []
    for node in nodes:
        cases = [c for c in collected if c == node or c.startswith(node + "[")]
        expanded += cases or [node]
    return expanded


def _pytest_cmd(targets: list[str], rootdir: Path, per_test: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "swap_plugin",
        "-p",
        "record_plugin",
        "-p",
        "no:cacheprovider",
        "-c",
        str(HERE / "pytest.ini"),
        "--rootdir",
        str(rootdir),
        "--confcutdir",
        str(rootdir),
        f"--timeout={per_test}",
        "--continue-on-collection-errors",
        "-q",
        *targets,
    ]


def _pytest_results(report: Path, marks: dict[str, set[str]], strategy: str) -> list[Result]:
    records: dict[str, list[dict]] = defaultdict(list)
    if report.exists():
        for line in report.read_text().splitlines():
            record = json.loads(line)
            records[record["id"]].append(record)
    results = []
    for test_id, recs in records.items():
        if any(r.get("standalone") for r in recs):  # its own run, not the skip in the main one
            recs = [r for r in recs if r.get("standalone")]
        failed = [r for r in recs if r["outcome"] == "failed"]
        call = [r for r in recs if r["when"] == "call"]
        skipped = [r for r in recs if r["outcome"] == "skipped"]
        duration = sum(r.get("duration", 0.0) for r in recs if r["rank"] == "0")
        if failed:
            first = failed[0]
            outcome = "failed" if first["when"] == "call" else "error"
            if first["when"] == "collect":
                outcome = "error"
            message = first.get("message", "")
        elif skipped:
            outcome, message = "skipped", skipped[0].get("message", "")
            if skipped[0].get("xfail"):
                message = f"xfail: {message}"
        elif call:
            outcome, message = "passed", ""
        else:
            outcome, message = "error", "no result: the run was killed (hung or past its timeout)"
        results.append(
            Result(test_id, outcome, message, _exercised(test_id, marks, strategy), duration)
        )
    return results


def _read_marks(path: Path) -> dict[str, set[str]]:
    marks: dict[str, set[str]] = defaultdict(set)
    if path.exists():
        for line in path.read_text().splitlines():
            test, _kind, cls = line.split("\t")
            marks[test].add(cls)
    return marks


def _exercised(test_id: str, marks: dict[str, set[str]], strategy: str) -> bool:
    if test_id.startswith("scripts/"):  # the script's Accelerator is built in main()
        prefix = test_id.split("::")[0] + "::"
        classes = set().union(*(v for k, v in marks.items() if k.startswith(prefix)))
    else:
        classes = marks.get(test_id, set())
    if strategy == "ddp":
        return bool(classes)
    return any(name.startswith("Zero") for name in classes)


# ------------------------------------------------------------------ suites
def run_pytest_suite(
    suite: str, strategy: str, entries: list[Entry], root: Path, rootdir: Path, args
) -> SuiteRun:
    run = SuiteRun(suite, strategy)
    work = Path(tempfile.mkdtemp(prefix=f"{suite}-{strategy}-", dir=args.work))
    log = work / "output.log"
    env = _environment(strategy, suite, work)
    if getattr(args, "cuda_on_cpu", False):
        env["ZERO_SWAP_CUDA_ON_CPU"] = "1"  # swap_plugin re-targets the CUDA-gated tests
    start = time.monotonic()
    plain = [e for e in entries if e.kind == "pytest"]
    env["ZERO_SWAP_FILTERS"] = json.dumps({e.target: e.pattern for e in plain if e.pattern})
    if plain:
        rc = _run(
            _pytest_cmd([e.target for e in plain], rootdir, args.per_test_timeout),
            root,
            env,
            args.run_timeout,
            log,
        )
        if rc is None:
            run.notes.append(f"the pytest run passed its {args.run_timeout}s limit and was killed")
    standalone_env = {**env, "PL_RUN_STANDALONE_TESTS": "1", "ZERO_SWAP_FILTERS": "{}"}
    standalone = [e.target for e in entries if e.kind == "standalone"]
    for test_id in _parametrizations(standalone, root, rootdir, standalone_env, work):
        _run(
            _pytest_cmd([test_id], rootdir, args.per_test_timeout),
            root,
            standalone_env,
            args.per_test_timeout + 60,
            log,
        )
    marks = _read_marks(work / "marks.tsv")
    run.results = _pytest_results(work / "report.jsonl", marks, strategy)
    for entry in (e for e in entries if e.kind == "script"):
        run.results += run_script(entry, strategy, env, work, args)
    run.wall = time.monotonic() - start
    run.notes.append(f"zero-strategy at {_code_state()}")
    run.notes.append(f"log: {log}")
    return run


CODE = ("zero_strategy",)


def _code_state() -> str:
    """The last commit of the code under test (it may change while the suites run for an
    hour), and whether the work tree has uncommitted changes to it."""
    git = ["git", "-C", str(REPO)]
    last = [*git, "log", "-1", "--format=%h", "--", *CODE]
    commit = subprocess.run(last, capture_output=True, text=True).stdout.strip()
    status = [*git, "status", "--porcelain", "--", *CODE]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return commit + (" + uncommitted changes" if dirty else "")


def run_script(entry: Entry, strategy: str, env: dict, work: Path, args) -> list[Result]:
    import accelerate.test_utils

    name = entry.target
    script = Path(accelerate.test_utils.__file__).parent / "scripts" / name
    results_dir = work / f"script-{Path(name).stem}"
    results_dir.mkdir()
    log = results_dir / "output.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / "accelerate_shim.py"),
        str(script),
        str(results_dir),
        entry.pattern or "",
    ]
    start = time.monotonic()
    env = {**env, "ACCELERATE_USE_CPU": "1"}  # as `accelerate launch --cpu` sets it
    rc = _run(cmd, results_dir, env, args.script_timeout, log)
    wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    errors = [m.group(1).strip() for line in text.splitlines() if (m := ERROR_LINE.match(line))]
    crash = errors[-1] if errors else f"exit code {rc}"
    if rc is None:
        crash = f"timed out after {args.script_timeout}s (hang?)"
    events: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for rank_file in sorted(results_dir.glob("rank*.jsonl")):
        for line in rank_file.read_text().splitlines():
            event = json.loads(line)
            events[event["id"]][rank_file.stem].append(event)
            if event["id"] not in order:
                order.append(event["id"])
    marks = _read_marks(work / "marks.tsv")
    results = []
    main_id = f"scripts/{name}::main"
    for test_id in [i for i in order if i != main_id] + [main_id]:
        per_rank = events.get(test_id, {})
        ends = [e for evs in per_rank.values() for e in evs if e["event"] != "start"]
        failed = [e for e in ends if e["event"] == "failed"]
        if failed:
            outcome, message = "failed", failed[0]["message"]
        elif ends and all(e["event"] == "skipped" for e in ends):
            outcome, message = "skipped", "left out by its `~ REGEX` in selection.txt"
        elif len(per_rank) == 2 and all(
            any(e["event"] in ("passed", "end") for e in evs) for evs in per_rank.values()
        ):
            outcome, message = "passed", ""
        else:
            outcome, message = "error", crash
        exercised = _exercised(test_id, marks, strategy)
        results.append(Result(test_id, outcome, message, exercised, round(wall, 1)))
    return results


# ------------------------------------------------------------------ report
def _table(runs: list[SuiteRun]) -> list[str]:
    lines = [
        "| strategy | passed | failed | errors | skipped | passed w/o the strategy | wall (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        c = run.counts()
        idle = sum(1 for r in run.results if r.outcome == "passed" and not r.exercised)
        lines.append(
            f"| {run.strategy} | {c['passed']} | {c['failed']} | {c['error']} | "
            f"{c['skipped']} | {idle} | {run.wall:.0f} |"
        )
    return lines


def report(runs: dict[tuple[str, str], SuiteRun], baseline_note: dict, args) -> str:
    expected = read_expected(HERE / "expected_non_ddp.txt")
    limits = read_limits(HERE / "known_limits.txt")
    date = datetime.date.today().isoformat()
    out = [
        f"# Maintainers' DDP tests with zero-strategy in DDP's place ({date})",
        "",
        f"Command: `{' ; '.join(dict.fromkeys(r.command for r in runs.values()))}`",
        "",
        "Each ZeRO run is the same selection (found by rule, scripts/maintainer_tests/rule.py, "
        "or with --select list the hand-made scripts/maintainer_tests/selection.txt) with "
        "every DDP strategy name, `DDPStrategy` instance and `Accelerator` resolved to "
        "zero-strategy's (scripts/maintainer_tests/swap_plugin.py). *passed w/o the "
        "strategy*: passed without ever building the strategy under test (a ZeRO strategy "
        "or accelerator; DDP's for the ddp row), i.e. not evidence for it.",
    ]
    for suite in dict.fromkeys(s for s, _ in runs):
        suite_runs = [runs[(s, st)] for s, st in runs if s == suite]
        out += ["", f"## {suite}", "", f"Source: {baseline_note[suite]}", ""]
        out += _table(suite_runs)
        for run in suite_runs:
            notes = [note for note in run.notes if not note.startswith("log")]
            out.append(f"- {run.strategy}: {'; '.join(notes)}")
        base = runs.get((suite, "ddp"))
        if base is None:
            continue
        passed_base = {r.id for r in base.results if r.outcome == "passed"}
        for run in suite_runs:
            if run.strategy == "ddp":
                continue
            lost = [r for r in run.results if r.id in passed_base and r.outcome != "passed"]
            internal = [r for r in lost if expected_reason(r.id, expected)]
            own_limits = [*limits.get(run.strategy, []), *limits.get("*", [])]
            limited = [r for r in lost if r not in internal and expected_reason(r.id, own_limits)]
            out += [
                "",
                f"### {run.strategy}: {len(lost)} tests pass under ddp but not here",
                "",
                f"{len(internal)} assert DDP's own internals (listed below), {len(limited)} are "
                f"known limits (scripts/maintainer_tests/known_limits.txt), "
                f"{len(lost) - len(internal) - len(limited)} unexplained; against the target "
                f"(within 3 of ddp, DDP internals left out): {len(lost) - len(internal)}.",
                "",
            ]
            for r in sorted(lost, key=lambda r: r.id):
                if expected_reason(r.id, expected):
                    tag = " *(DDP internals)*"
                elif reason := expected_reason(r.id, own_limits):
                    tag = f" *(known limit: {reason})*"
                else:
                    tag = ""
                out.append(f"- `{r.id}` **{r.outcome}**{tag}: {one_line(r.message)}")
    out += [
        "",
        "## Tests no non-DDP strategy can pass",
        "",
        "From scripts/maintainer_tests/expected_non_ddp.txt (id pattern | reason):",
        "",
    ]
    out += [f"- `{pattern}`: {reason}" for pattern, reason in expected]
    return "\n".join(out) + "\n"


def one_line(message: str, limit: int = 240) -> str:
    """An error message on one line: an assertion's first line is often generic ("Did
    not obtain the same model"), so its next lines follow, separated by " / "."""
    text = " / ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _results_file(suite: str, strategy: str, select: str) -> Path:
    """Saved results, one file per selection kind: a baseline compares like with like."""
    tag = {"list": "", "rule": "-rule"}.get(select, f"-{select}")
    return sources.CACHE / "results" / f"{suite}-{strategy}{tag}.json"


def _save(run: SuiteRun, select: str) -> None:
    path = _results_file(run.suite, run.strategy, select)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**asdict(run), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    path.write_text(json.dumps(data, indent=1))


def _load(suite: str, strategy: str, select: str) -> SuiteRun | None:
    path = _results_file(suite, strategy, select)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    results = [Result(**r) for r in data["results"]]
    run = SuiteRun(suite, strategy, results, data["wall"], command=data.get("command", ""))
    run.notes = [*data["notes"], f"results of the run of {data['date']}"]
    return run


def _rule_entries(root: Path, cuda_only: bool = False) -> tuple[list[Entry], str]:
    """Lightning's entries found by rule (rule.py), and a line that counts them; with
    `cuda_only`, those gated on 2+ CUDA devices alone."""
    found = rule.lightning_ddp_tests(root)
    if cuda_only:
        found = [f for f in found if f.cuda_gated]
    entries = [Entry("standalone", f.node) for f in found if f.standalone]
    # The others by file, each with a filter of its test names: a node id in a module that
    # cannot be imported (a missing optional dependency) would end the whole pytest run,
    # where a file is one collection error and the run goes on.
    by_file: dict[str, list[str]] = defaultdict(list)
    for f in found:
        if not f.standalone:
            path, *_, name = f.node.split("::")
            by_file[path].append(re.escape(name))
    for path, names in by_file.items():
        entries.append(Entry("pytest", path, rf"^({'|'.join(names)})(\[|$)"))
    files = len({f.node.split("::")[0] for f in found})
    gated = sum(f.cuda_gated for f in found)
    standalone = sum(f.standalone for f in found)
    note = (
        f"selected by rule (scripts/maintainer_tests/rule.py): {len(found)} test functions in "
        f"{files} files, {standalone} of them standalone, {gated} gated on 2+ CUDA devices "
        + (
            "(only those, re-targeted to the CPU: --cuda-on-cpu)"
            if cuda_only
            else "(they skip on CPU)"
        )
    )
    return entries, note


def _accelerate_rule_entries(root: Path) -> tuple[list[Entry], str]:
    """Accelerate's entries found by rule (rule.py): the tests that launch DDP in the test
    process (debug_launcher) run as they are; the scripts that the multi-device tests
    launch run under torchrun on 2 CPU processes (re-targeted: the tests themselves skip
    without 2 accelerators)."""
    import accelerate.test_utils

    scripts_dir = Path(accelerate.test_utils.__file__).parent / "scripts"
    found = rule.accelerate_ddp_tests(root, scripts_dir)
    by_file: dict[str, list[str]] = defaultdict(list)
    for f in found:
        if f.kind == "in-process":
            path, *_, name = f.node.split("::")
            by_file[path].append(re.escape(name))
    entries = [Entry("pytest", p, rf"^({'|'.join(n)})(\[|$)") for p, n in by_file.items()]
    launched = [f for f in found if f.kind == "launched"]
    scripts = list(dict.fromkeys(s for f in launched for s in f.scripts))
    for script in scripts:
        left_out = rule.SCRIPT_EXCLUDED.get(Path(script).name)
        entries.append(Entry("script", script, rf"^(?!{left_out[0]}$)" if left_out else None))
    unreachable = [f.node for f in launched if not f.scripts]
    note = (
        f"selected by rule (scripts/maintainer_tests/rule.py): {len(found)} tests, "
        f"{len(found) - len(launched)} launching DDP in the test process (debug_launcher), "
        f"{len(launched)} launching a multi-process command (gated on 2+ accelerators): "
        f"{len(scripts)} scripts they run re-targeted to 2 CPU processes "
        f"({', '.join(scripts)}); {len(unreachable)} launch their own test file or an "
        f"example, which the runner cannot re-target ({', '.join(unreachable)})"
    )
    excluded = [f"{k}::{v[0]} ({v[1]})" for k, v in rule.SCRIPT_EXCLUDED.items()]
    if excluded:
        note += "; left out: " + "; ".join(excluded)
    return entries, note


def ensure_deps() -> None:
    missing = []
    for module, requirement in EXTRA_DEPS.items():
        probe = [sys.executable, "-c", f"import {module}"]
        env = {**os.environ, "PYTHONPATH": str(DEPS)}
        if subprocess.run(probe, env=env, capture_output=True).returncode != 0:
            missing.append(requirement)
    if missing:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade"]
        subprocess.run([*pip, "--target", str(DEPS), *missing], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--suite", default="all", choices=["lightning", "accelerate", "all"])
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/...<date>.md")
    parser.add_argument("--git-mirror", action="append", default=[], help="local git mirror")
    parser.add_argument("--refresh", action="store_true", help="fetch the sources again")
    parser.add_argument("--per-test-timeout", type=int, default=240)
    parser.add_argument("--run-timeout", type=int, default=1800, help="one pytest run")
    parser.add_argument("--script-timeout", type=int, default=420)
    parser.add_argument("--selection", type=Path, default=HERE / "selection.txt")
    parser.add_argument(
        "--select",
        default="rule",
        choices=["rule", "list"],
        help="every DDP test of Lightning and Accelerate found by rule (rule.py), or the list's",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the report from the saved results"
    )
    parser.add_argument(
        "--cuda-on-cpu",
        action="store_true",
        help="only Lightning's tests gated on 2+ CUDA devices, re-targeted to the CPU "
        "(swap_plugin.py); their results are kept apart from the full run's",
    )
    args = parser.parse_args()
    select = "rule-cuda" if args.cuda_on_cpu else args.select  # results kept apart
    suites = ["lightning", "accelerate"] if args.suite == "all" else [args.suite]
    args.work = Path(tempfile.mkdtemp(prefix="maintainer-tests-"))
    selection = read_selection(args.selection)
    keep = args.selection.resolve() == (HERE / "selection.txt")  # save only full runs
    if not args.report_only:
        ensure_deps()
    notes, runs = {}, {}
    for suite in suites:
        entry = sources.obtain(suite, args.git_mirror, args.refresh)
        notes[suite] = sources.source_note(entry)
        root = entry / "tests" if suite == "lightning" else entry
        entries = selection[suite]
        if args.select == "rule":
            if suite == "lightning":
                entries, found_note = _rule_entries(root, cuda_only=args.cuda_on_cpu)
            else:
                entries, found_note = _accelerate_rule_entries(root)
            notes[suite] += f"; {found_note}"
        for strategy in args.strategies:
            if args.report_only:
                if saved := _load(suite, strategy, select):
                    runs[(suite, strategy)] = saved
                continue
            print(f"[{suite}] {strategy} ...", flush=True)
            run = run_pytest_suite(suite, strategy, entries, root, root, args)
            if keep:
                _save(run, select)
            runs[(suite, strategy)] = run
            c = run.counts()
            print(f"[{suite}] {strategy}: {c} in {run.wall:.0f}s ({run.notes[-1]})", flush=True)
        if "ddp" not in args.strategies and keep and (base := _load(suite, "ddp", select)):
            runs = {(suite, "ddp"): base, **runs}
    text = report(runs, notes, args)
    date = datetime.date.today().isoformat()
    output = args.output or REPO / "benchmarks" / "results" / f"maintainer_tests_{date}.md"
    output.write_text(text)
    print(text)
    print(f"written to {output}")


if __name__ == "__main__":
    main()
