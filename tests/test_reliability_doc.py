"""docs/reliability.md names a test for every fault and every user error it lists: each
named test must exist, and the catalogue of user errors must stay at least 40 cases."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"


def _defined_tests() -> set[str]:
    found = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for name in re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M):
            found.add(f"tests/{path.name}::{name}")
    return found


def test_every_test_the_reliability_doc_names_exists():
    named = set(re.findall(r"(tests/test_\w+\.py::test_\w+)", DOC.read_text()))
    assert len(named) > 50
    assert sorted(named - _defined_tests()) == []


def test_the_catalogue_lists_at_least_40_user_errors_each_with_its_test():
    text = DOC.read_text().split("## Bad input, catalogued", 1)[1]
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 40
    assert all(re.search(r"tests/test_\w+\.py::test_\w+", row) for row in rows)
    assert len({row.split("|")[3].strip() for row in rows}) == len(rows)  # distinct inputs
