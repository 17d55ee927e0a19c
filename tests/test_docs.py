"""The documents that promise something checkable: docs/flags.md is what the parser says, and the
README's first screen gives install, serve, a call and the very test command CI runs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import flags_table  # noqa: E402

FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")


def serve_help() -> str:
    done = subprocess.run([sys.executable, "-m", "app", "serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHON_COLORS": "0"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_flags(text: str) -> set[str]:
    """Every flag `--help` lists: the invocation part of each option line (indented two spaces)."""
    found = set()
    for line in text.splitlines():
        if re.match(r"^  -", line):
            found.update(FLAG.findall(re.split(r"\s{2,}", line.strip())[0]))
    return found


def test_the_flag_table_is_generated_from_the_parser():
    page = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert page == flags_table.render(), "docs/flags.md is stale: run python tools/flags_table.py --write"


def test_every_flag_in_serve_help_is_in_the_table():
    listed = help_flags(serve_help())
    assert {"--model", "--max-num-seqs", "-np", "--api-key", "--max-connections", "--config"} <= listed
    table = set()
    for line in (ROOT / "docs" / "flags.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            table.update(FLAG.findall(line.split(" | ")[0]))
    missing = listed - table - {"-h", "--help"}
    assert not missing, f"in `spool serve --help` but not in docs/flags.md: {sorted(missing)}"


def ci_test_command() -> str:
    """The pytest line .ci/run runs (the README's test command, byte for byte)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if re.match(r"^\s*python3? -m pytest\b", line)]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_readme_opens_with_install_serve_call_and_test():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = readme.splitlines()[:40]
    text = "\n".join(first)
    assert "pip install" in text
    assert "spool serve" in text or "python -m app serve" in text
    assert "curl " in text or "OpenAI(" in text
    assert ci_test_command() in [line.strip() for line in first]


def test_the_readme_test_section_holds_ci_s_command_in_a_code_block():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert any(ci_test_command() in block.splitlines() for block in blocks), section


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -."""
    found = set()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


def test_the_docs_links_point_at_files_and_headings_that_exist():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path) if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_benchmarks_holds_today_only():
    lines = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    assert (ROOT / "docs" / "benchmarks-history.md").is_file()
