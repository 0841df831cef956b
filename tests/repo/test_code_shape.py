"""The code stays enterable: no library function takes more than MAX_PARAMETERS parameters (a longer list wants a
config object or a split), every module opens with a docstring saying what it is, `ruff format` leaves the
repository as it is, and the linter's configuration is the one CI runs."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.repo import PACKAGES, ROOT

MAX_PARAMETERS = 8
"""Positional, keyword-only, *args and **kwargs, counted together; `self` and `cls` not counted."""


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (positional[:1] in (["self"], ["cls"]))


def is_pallas_kernel(path: Path, node, base: Path) -> bool:
    """A Pallas kernel body (pallas_call passes it one ref per operand and output): exempt."""
    return path.relative_to(base).parts[0] == "pallas_kernels" and node.name.endswith("_kernel")


def wide_functions(roots=PACKAGES, limit=MAX_PARAMETERS, base=ROOT) -> dict[str, int]:
    """ "path:line name" -> parameter count of every function over `limit`, nested ones included."""
    found = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_pallas_kernel(path, node, base):
                    continue
                if (count := parameter_count(node)) > limit:
                    found[f"{path.relative_to(base)}:{node.lineno} {node.name}"] = count
    return found


def modules_without_docstring(roots=PACKAGES, base=ROOT) -> list[str]:
    return [
        str(path.relative_to(base))
        for root in roots
        for path in sorted((base / root).rglob("*.py"))
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]


def test_no_function_takes_more_than_8_parameters():
    assert wide_functions() == {}


def test_the_check_sees_a_wide_function_and_exempts_only_pallas_kernel_bodies(tmp_path):
    """Nine parameters are one too many whatever their kind; `self` is not counted; a `*_kernel` body is exempt in
    pallas_kernels/ only."""
    nine = "a, b, c, d, e, f, *rest, g, **extra"
    for package in ("ptd_jax", "pallas_kernels"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text(
            f"def wide({nine}):\n    pass\n\n\n"
            f"def fused_kernel({nine}):\n    pass\n\n\n"
            "class C:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n"
        )
    assert wide_functions(base=tmp_path) == {
        "ptd_jax/m.py:1 wide": 9,
        "ptd_jax/m.py:5 fused_kernel": 9,
        "pallas_kernels/m.py:1 wide": 9,
    }


def test_every_module_opens_with_a_docstring():
    assert modules_without_docstring() == []


def test_the_docstring_check_sees_a_module_without_one(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bare.py").write_text("import os\n")
    (tmp_path / "pkg" / "told.py").write_text('"""What this is."""\n\nimport os\n')
    assert modules_without_docstring(("pkg",), tmp_path) == ["pkg/bare.py"]


def test_ruff_format_leaves_the_repository_as_it_is():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip(f"ruff is not installed next to {sys.executable} (pip install -e '.[test]')")
    out = subprocess.run([str(ruff), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_is_configured_and_in_the_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "select" in project["tool"]["ruff"]["lint"]
    assert any(dep.startswith("ruff") for dep in project["project"]["optional-dependencies"]["test"])
