"""The code stays enterable: no function in the library over MAX_FUNCTION_LINES lines (a long function is a list of
steps that wants names), and the linter's configuration is the one CI runs."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def long_functions(roots=("ptd_jax", "pallas_kernels"), limit=MAX_FUNCTION_LINES, base=ROOT) -> dict[str, int]:
    found = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found[f"{path.relative_to(base)}:{node.lineno} {node.name}"] = lines
    return found


def test_no_function_is_over_the_limit():
    assert long_functions() == {}


def test_the_check_sees_a_long_function(tmp_path):
    """The walker finds a function one line over the limit (so the test above can fail)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(("pkg",), base=tmp_path) == {"pkg/m.py:1 f": MAX_FUNCTION_LINES + 1}


def test_ruff_is_configured_and_in_the_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "select" in project["tool"]["ruff"]["lint"]
    assert any(dep.startswith("ruff") for dep in project["project"]["optional-dependencies"]["test"])
