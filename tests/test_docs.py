"""The documents that promise something checkable: docs/flags.md is what the parser says."""

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
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
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
