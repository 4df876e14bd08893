"""The layers of `docs/architecture.md`, held against the code's own imports: a module
imports from its own package or from a lower layer, never from a higher one or a peer.
A change that needs an upward import has found a type that belongs lower down."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "zero_strategy"

# Bottom up; the packages (or top-level modules) of one row are peers: they import nothing
# from one another. The same table is in docs/architecture.md.
LAYERS = [
    {"config", "private_api", "kernels"},
    {"tensor_parallel"},
    {"layout"},
    {"comm"},
    {"units", "moe"},
    {"offload"},
    {"optim"},
    {"model_view", "checkpoint", "memory"},
    {"builder"},
    {"engine", "cli", "deepspeed_config", "__init__"},
]
LEVEL = {name: i for i, row in enumerate(LAYERS) for name in row}
# DESIGN.md: the core never imports these (Transformers it may: it loads and shards HF models).
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "hydra", "omegaconf")


def _part_of(path: Path) -> str:
    rel = path.relative_to(CORE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, int]]:
    """(first name under zero_strategy, line) of every import of the core in `path`,
    including imports inside functions."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(CORE).parent.parts)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = [*base, *(node.module.split(".") if node.module else [])]
                if not parts:  # from . import a, b: each name is a part
                    found += [(alias.name, node.lineno) for alias in node.names]
                else:
                    found.append((parts[0], node.lineno))
            elif node.module and node.module.split(".")[0] == "zero_strategy":
                parts = node.module.split(".")[1:]
                if parts:
                    found.append((parts[0], node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "zero_strategy" and len(parts) > 1:
                    found.append((parts[1], node.lineno))
    return found


def _core_files() -> list[Path]:
    return sorted(
        p for p in CORE.rglob("*.py") if "kernels" not in p.parts and "integrations" not in p.parts
    )


def test_every_core_part_has_a_layer():
    parts = {_part_of(p) for p in _core_files()}
    assert parts <= set(LEVEL), f"parts with no layer: {sorted(parts - set(LEVEL))}"


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_imports_point_down_the_layers(path):
    mine = _part_of(path)
    wrong = [
        f"line {line}: {mine} (layer {LEVEL[mine]}) imports {other} (layer {LEVEL[other]})"
        for other, line in _imports(path)
        if other != mine and other in LEVEL and LEVEL[other] >= LEVEL[mine] and mine != "__init__"
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_the_core_never_imports_a_framework(path):
    tree = ast.parse(path.read_text())
    names = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for alias in (node.names if isinstance(node, ast.Import) else [node])
    ]
    used = sorted({n.split(".")[0] for n in names if n and n.split(".")[0] in FRAMEWORKS})
    allowed = {"__init__.py"}  # registers the integrations, which import them lazily
    assert not used or path.name in allowed, f"{path}: imports {used}"


def test_kernels_never_import_the_core():
    for path in (CORE / "kernels").rglob("*.py"):
        text = path.read_text()
        assert "zero_strategy" not in text.replace("zero_strategy.kernels", ""), path
        assert "from .." not in text, path
