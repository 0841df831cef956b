"""README's first block holds exactly the two set-up commands, and .ci/run runs the second one verbatim."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    block = lines[start + 1: lines.index("```", start + 1)]
    return [line for line in block if line.strip() and not line.startswith("#")]


def test_readme_top_has_two_commands():
    commands = readme_commands()
    assert len(commands) == 2
    install_and_train, install_and_test = commands
    assert "pip install -e ." in install_and_train and install_and_train.endswith("ptd-train")
    assert "'.[test]'" in install_and_test and "pytest" in install_and_test


def test_ci_runs_the_readme_test_command():
    """.ci/run extracts the command with awk; run that extraction and compare."""
    script = (ROOT / ".ci" / "run").read_text()
    extraction = next(line for line in script.splitlines() if line.startswith("test_command="))
    command = extraction.split("=", 1)[1]
    got = subprocess.run(["bash", "-c", f"echo {command}"], cwd=ROOT, capture_output=True, text=True).stdout
    assert got.strip() == readme_commands()[1]
