"""Lightning's and Accelerate's DDP tests found by rule, not by hand.

Accelerate's rule is below `accelerate_ddp_tests`. Lightning's:

A test is selected when it runs a DDP strategy: its source, its decorators (a
`parametrize` list included) or a helper function or class of its module that it calls
names one, as a string (`"ddp"`, `"ddp_spawn"`, `"ddp_fork"`, `"ddp_notebook"`, each
with or without `_find_unused_parameters_true/false`) or as `DDPStrategy(...)`. That is
how Lightning's tests choose DDP; a test that reaches DDP only through a fixture or a
helper of another module is missed, and the report counts what was found.

`@RunIf(standalone=True)` tests run one per process (`standalone` entries). Tests gated on
two or more CUDA devices are selected too; on a CPU-only machine they skip themselves, and
the report counts them apart.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

DDP = re.compile(
    r"""["']ddp(_spawn|_fork|_notebook)?(_find_unused_parameters_(true|false))?["']"""
    r"""|\bDDPStrategy\("""
)
CUDA_GATED = re.compile(r"min_cuda_gpus\s*=\s*[2-9]")
STANDALONE = re.compile(r"standalone\s*=\s*True")
FOLDERS = ("tests_pytorch", "tests_fabric")


@dataclass(frozen=True)
class Found:
    node: str  # path::[Class::]function, relative to the tests folder
    standalone: bool
    cuda_gated: bool


def _source(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node) or ""


def _tests_of(tree: ast.Module) -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test_"
        ):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found += [
                (f"{node.name}::{f.name}", f)
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            ]
    return found


def lightning_ddp_tests(tests_root: Path) -> list[Found]:
    """Every test of Lightning's tests_pytorch and tests_fabric that runs DDP."""
    out = []
    for folder in FOLDERS:
        for path in sorted((tests_root / folder).rglob("test_*.py")):
            text = path.read_text()
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            helpers = {
                node.name: _source(text, node)
                for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                and not node.name.startswith("test_")
            }
            for name, func in _tests_of(tree):
                decorators = "\n".join(_source(text, d) for d in func.decorator_list)
                called = {
                    n.func.id
                    for n in ast.walk(func)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                }
                reached = (
                    decorators + _source(text, func) + "".join(helpers.get(c, "") for c in called)
                )
                if DDP.search(reached):
                    node = f"{path.relative_to(tests_root)}::{name}"
                    out.append(
                        Found(
                            node,
                            bool(STANDALONE.search(decorators)),
                            bool(CUDA_GATED.search(decorators)),
                        )
                    )
    return out


# ---------------------------------------------------------------- Accelerate
# Accelerate chooses DDP by launching more than one process: in the test process with
# `debug_launcher(fn)` (2 CPU processes unless `num_processes=1`), or as a command
# (`get_launch_command(...)`, `torchrun`) running one of its test_utils/scripts, gated on
# several accelerators (`require_multi_device`/`require_multi_gpu`). The runner re-targets
# the latter to 2 CPU processes by running the script under torchrun itself.
DEBUG_LAUNCHER = "debug_launcher"
LAUNCHED = re.compile(
    r"execute_subprocess_async\(|get_launch_command\(|DEFAULT_LAUNCH_COMMAND|torch\.distributed\.run"
)
# Another distributed type than DDP (or a feature beside it the CPU cannot run).
OTHER_TYPE = re.compile(r"deepspeed|fsdp|megatron|xla|tpu|fp8|pippy|ulysses|tensor_parallel", re.I)
# A script's path as the tests build it: path_in_accelerate_package("test_utils",
# "scripts", ["external_deps",] "test_x.py").
SCRIPT = re.compile(r"""["']scripts["']\s*,\s*((?:["'][\w.]+["']\s*,\s*)*["']test_\w+\.py["'])""")
REQUIRES_NOT = re.compile(r"\brequire_non_\w+")  # "not on XLA": no other type named
# Checks of a script that hang under DDP itself on CPU, with the reason: left out.
SCRIPT_EXCLUDED = {
    "test_distributed_data_loop.py": (
        "test_can_join_uneven_inputs",
        "hangs on CPU under DDP itself (gloo send timeout) and breaks the group for every "
        "later check",
    ),
}


@dataclass(frozen=True)
class AccelerateFound:
    node: str  # tests/...::Class::test, relative to the checkout
    kind: str  # "in-process" (debug_launcher) or "launched" (a script re-targeted to CPU)
    scripts: tuple[str, ...] = ()  # launched: the test_utils/scripts it runs


def _launcher_calls(func: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(func)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == DEBUG_LAUNCHER)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == DEBUG_LAUNCHER)
        )
    ]


def _processes(call: ast.Call) -> int:
    for kw in call.keywords:
        if kw.arg == "num_processes" and isinstance(kw.value, ast.Constant):
            return int(kw.value.value)
    return 2  # debug_launcher's default


def _unittest_tests(tree: ast.Module) -> list[tuple[str, ast.FunctionDef, ast.ClassDef | None]]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            found.append((node.name, node, None))
        elif isinstance(node, ast.ClassDef):
            found += [
                (f"{node.name}::{f.name}", f, node)
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            ]
    return found


def _script_paths(segment: str) -> list[str]:
    return [
        "/".join(re.findall(r"""["']([\w.]+)["']""", m.group(1))) for m in SCRIPT.finditer(segment)
    ]


def _named_scripts(text: str, tree: ast.Module, cls: ast.ClassDef | None) -> dict[str, list[str]]:
    """name -> the scripts assigned to it: module and class attributes, and `self.x = ...`
    in the class's setUp/setUpClass."""
    bodies = [tree.body]
    if cls is not None:
        bodies.append(cls.body)
        bodies += [
            f.body
            for f in cls.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("setUp")
        ]
    named: dict[str, list[str]] = {}
    for body in bodies:
        for stmt in body:
            if not isinstance(stmt, ast.Assign):
                continue
            scripts = _script_paths(_source(text, stmt))
            for target in stmt.targets:
                key = (
                    target.attr
                    if isinstance(target, ast.Attribute)
                    else getattr(target, "id", None)
                )
                if key and scripts:
                    named[key] = scripts
    return named


def accelerate_ddp_tests(root: Path, scripts_dir: Path) -> list[AccelerateFound]:
    """Every test of Accelerate's tests/ that runs DDP on more than one process."""
    out = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        text = path.read_text()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for name, func, cls in _unittest_tests(tree):
            own = "\n".join(_source(text, d) for d in func.decorator_list) + _source(text, func)
            if cls is not None:
                own += "\n".join(_source(text, d) for d in cls.decorator_list)
            if OTHER_TYPE.search(REQUIRES_NOT.sub("", own)) or OTHER_TYPE.search(path.name):
                continue
            node = f"{path.relative_to(root)}::{name}"
            if any(_processes(c) > 1 for c in _launcher_calls(func)):
                out.append(AccelerateFound(node, "in-process"))
                continue
            if not LAUNCHED.search(own):
                continue
            named = _named_scripts(text, tree, cls)
            body = _source(text, func)
            used = set(re.findall(r"\b(\w+)\b", body))
            scripts = _script_paths(body) + [s for k, v in named.items() if k in used for s in v]
            scripts = [s for s in dict.fromkeys(scripts) if (scripts_dir / s).is_file()]
            out.append(AccelerateFound(node, "launched", tuple(scripts)))
    return out
