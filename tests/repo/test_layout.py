"""The architecture's rules, checked on the source (docs/architecture.md, "Layout"): imports flow one way
(config, data -> model, optimizer -> parallel -> perf -> train -> the CLI), no import cycles anywhere (experiments/
and the tests included), no private names across packages, `pallas_kernels` independent of `ptd_jax`, the library
independent of `experiments` and each experiments room importing only `experiments.common` of the others, the
schedule modules free of JAX; and the tests' own rule: a test module imports tests/helpers/, never another test
module or conftest."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import PACKAGES, ROOT

ALL_ROOTS = (*PACKAGES, "experiments", "tests")
"""Every folder of Python modules in the repository: the cycle check covers them all."""

# Layer of each part: a module may import its own layer or lower ones only (cycles within a layer are checked
# separately). The kernels sit below everything and import nothing of ptd_jax.
LAYERS = [
    ("pallas_kernels", 0),
    ("ptd_jax.config", 1),
    ("ptd_jax.presets", 1),
    ("ptd_jax.analysis", 1),
    ("ptd_jax.data", 2),
    ("ptd_jax.runtime", 2),
    ("ptd_jax.model", 3),
    ("ptd_jax.optimizer", 3),
    ("ptd_jax.loss_scale", 3),
    ("ptd_jax.interop", 3),
    ("ptd_jax.parallel", 4),
    ("ptd_jax.perf", 5),
    ("ptd_jax.inference", 6),
    ("ptd_jax.train", 6),
    ("ptd_jax.aot", 6),
    ("ptd_jax.cli", 7),
]


def module_files(roots=PACKAGES) -> dict[str, Path]:
    mods = {}
    for package in roots:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def layer(module: str) -> int:
    matches = [(len(prefix), rank) for prefix, rank in LAYERS if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} has no layer in LAYERS"
    return max(matches)[1]


def imports(path: Path, module: str, mods: dict):
    """(imported module, imported name or None, line) for every import statement, lazy ones included."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, None, node.lineno) if sub in mods else (base, alias.name, node.lineno)


def graph(roots=PACKAGES):
    """Module -> modules it makes Python run (explicit targets and their parent packages, except its own), over the
    modules under `roots`."""
    mods = module_files(roots)
    edges: dict[str, set] = {m: set() for m in mods}
    records = []
    for module, path in mods.items():
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")) + 1)}
        for target, name, line in imports(path, module, mods):
            if target.split(".")[0] not in roots:
                continue
            records.append((module, target, name, line))
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in mods and dep != module and (dep not in ancestors or dep == target and name):
                    edges[module].add(dep)
    return edges, records


def test_no_import_cycles():
    edges, _ = graph(ALL_ROOTS)
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_the_library_does_not_import_the_experiments():
    _, records = graph(ALL_ROOTS)
    found = [
        f"{m}:{line} imports {t}"
        for m, t, _, line in records
        if m.split(".")[0] in PACKAGES and t.split(".")[0] == "experiments"
    ]
    assert found == []


def test_experiment_rooms_share_only_common():
    """A script in experiments/<room>/ imports its own room, `experiments.common` and the library, no other room."""
    _, records = graph(("experiments",))
    crossing = []
    for m, t, n, line in records:
        parts = m.split(".")
        if len(parts) < 3:  # experiments.common, experiments itself
            continue
        target = f"{t}.{n}" if n else t
        if target != "experiments.common" and target.split(".")[:2] not in (
            ["experiments", parts[1]],
            ["experiments", "common"],
        ):
            crossing.append(f"{m}:{line} imports {target}")
    assert crossing == []


def test_imports_flow_one_way():
    _, records = graph()
    upward = [f"{m}:{line} imports {t}" for m, t, _, line in records if layer(t) > layer(m)]
    assert upward == []


def owner(module: str, mods: dict) -> str:
    """The package a module belongs to (a package's `__init__` belongs to the package itself)."""
    return module if mods[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_private_names_across_packages():
    """A private module or name (leading underscore) is used only inside the (sub)package that defines it."""
    mods = module_files()
    _, records = graph()
    private = []
    for m, t, n, line in records:
        parts = t.split(".")
        first_private = next((i for i, part in enumerate(parts) if part.startswith("_")), None)
        if first_private is not None:  # a private module: its package is the one above it
            defining = ".".join(parts[:first_private])
        elif (n or "").startswith("_"):
            defining = owner(t, mods) if t in mods else t
        else:
            continue
        if owner(m, mods) != defining:
            private.append(f"{m}:{line} imports {t}{'.' + n if n else ''}")
    assert private == []


def test_the_tests_import_no_private_names_of_the_packages():
    mods = module_files()
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for target, name, line in imports(path, "tests", mods):
            if target.split(".")[0] in PACKAGES and (
                any(p.startswith("_") for p in target.split(".")) or (name or "").startswith("_")
            ):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    assert found == []


def test_the_tests_import_helpers_not_other_tests():
    """Shared code lives in tests/helpers/: no module under tests/ imports conftest or a test module."""
    mods = module_files(("tests",))
    found = [
        f"{module}:{line} imports {target}{'.' + name if name else ''}"
        for module, path in mods.items()
        for target, name, line in imports(path, module, mods)
        if target.split(".")[0] in ("tests", "conftest")
        and any(part == "conftest" or part.startswith("test_") for part in f"{target}.{name or ''}".split("."))
    ]
    assert found == []


def test_no_module_names_a_schedule():
    """A schedule's properties are data (`config.SCHEDULE_SPECS`): outside config.py no library module compares a
    value with a schedule's name."""
    from ptd_jax.config import PIPELINE_SCHEDULES

    names = set(PIPELINE_SCHEDULES)
    found = []
    for module, path in module_files(("ptd_jax",)).items():
        if module == "ptd_jax.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                        found.append(f"{module}:{node.lineno}")
    assert found == []


def test_the_pipeline_package_imports_no_private_name_of_a_sibling():
    _, records = graph()
    found = [
        f"{m}:{line} imports {t}.{n}"
        for m, t, n, line in records
        if m.startswith("ptd_jax.parallel.pipeline")
        and t.startswith("ptd_jax.parallel.pipeline")
        and (n or "").startswith("_")
    ]
    assert found == []


def test_schedules_are_pure_python():
    code = (
        "import sys; import ptd_jax.parallel.pipeline, ptd_jax.cli.schedule, ptd_jax.data, "
        "ptd_jax.perf.flops; "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
