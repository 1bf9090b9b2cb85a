"""The building blocks stay pure torch: their files import no fairseq (DEVELOPERS guide), so
they can be copied into another code base or tested without fairseq installed."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fairseq_admin_pos"
PURE = ("admin", "positional", "profiling", "schemes")
STDLIB = {"__future__", "contextlib", "json", "math", "numbers", "os", "tempfile", "typing"}


def imported_modules(path: Path) -> set:
    """Every module named by an ``import`` / ``from ... import`` anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("name", PURE)
def test_building_block_imports_only_torch_and_stdlib(name):
    allowed_own = {f"fairseq_admin_pos.{m}" for m in PURE}
    bad = {m for m in imported_modules(PKG / f"{name}.py")
           if m.split(".")[0] not in STDLIB | {"torch"} and m not in allowed_own}
    assert not bad, f"{name}.py imports {sorted(bad)}"


def test_the_check_sees_a_fairseq_import():
    glue = PKG / "models" / "layers.py"
    assert any(m.startswith("fairseq.") for m in imported_modules(glue))
