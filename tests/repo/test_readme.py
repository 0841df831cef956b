"""The documentation's checkable facts: README.md's first block holds exactly the two set-up commands and .ci/run
runs the second one verbatim; every link of README.md and docs/architecture.md points at a file in the repository,
every status line cites its evidence, and neither cites issue numbers or commit hashes."""

import re
import subprocess

from tests.helpers.repo import ROOT

README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
INSTALL_AND_TRAIN = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/ptd-train"
INSTALL_AND_TEST = (
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/ruff format --check && "
    ".venv/bin/ruff check && .venv/bin/python -m pytest -q"
)


def readme_commands(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("```bash")
    block = lines[start + 1 : lines.index("```", start + 1)]
    return [line for line in block if line.strip() and not line.startswith("#")]


def links(markdown: str) -> list[str]:
    """Relative targets of markdown links `[text](target)`, anchors dropped; web addresses and pure anchors skipped."""
    targets = [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", markdown)]
    return [t for t in targets if t and not re.match(r"[a-z]+://|mailto:", t)]


def stale_references(text: str) -> list[str]:
    """Issue numbers ("#12", "issue 14") and commit hashes (7+ hex digits with at least one letter and one digit)."""
    found = re.findall(r"(?<![\w&])#\d+\b", text) + re.findall(r"\bissues? \d+", text, flags=re.IGNORECASE)
    found += [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    return found


def test_readme_top_has_the_two_commands():
    assert readme_commands(README.read_text()) == [INSTALL_AND_TRAIN, INSTALL_AND_TEST]


def test_ci_runs_the_readme_test_command():
    """.ci/run extracts the command with awk; run that extraction and compare."""
    script = (ROOT / ".ci" / "run").read_text()
    extraction = next(line for line in script.splitlines() if line.startswith("test_command="))
    command = extraction.split("=", 1)[1]
    got = subprocess.run(["bash", "-c", f"echo {command}"], cwd=ROOT, capture_output=True, text=True).stdout
    assert got.strip() == INSTALL_AND_TEST


def test_every_link_in_the_docs_points_at_a_file_in_the_repository():
    missing = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in (README, ARCHITECTURE)
        for target in links(doc.read_text())
        if not (doc.parent / target).exists()
    ]
    assert missing == []


def test_every_status_line_cites_its_evidence():
    section = README.read_text().split("## Status", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(bullets) >= 10
    unproven = [b for b in bullets if not b.startswith("- Not yet") and not links(b)]
    assert unproven == []


def test_the_docs_cite_no_issue_numbers_or_commits():
    found = {doc.name: stale_references(doc.read_text()) for doc in (README, ARCHITECTURE)}
    assert found == {"README.md": [], "architecture.md": []}


def test_stale_reference_finder_finds_them():
    assert stale_references("see #12, issue 14 and commit 2f9154b") == ["#12", "issue 14", "2f9154b"]
    assert stale_references("Takeaway #1, (d, p, t) = (2, 2, 2), 1e-12, 0xdead, deadbeef") == ["#1"]
