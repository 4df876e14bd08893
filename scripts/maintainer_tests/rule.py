"""Lightning's DDP tests found by rule, not by hand.

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
