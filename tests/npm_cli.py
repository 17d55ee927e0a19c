"""A coding agent's CLI from npm for the end-to-end tests, installed once into a cache folder
($SPOOL_AGENTS_DIR, else ~/.cache/spool/agents), and a skip where npm or its registry is not
there: the agents' protocols are tested, not the machine's network."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def npm_cli(package: str, command: str) -> Path:
    """The path of command, from package installed under the cache folder."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    cache = Path(os.environ.get("SPOOL_AGENTS_DIR", Path.home() / ".cache" / "spool" / "agents"))
    prefix = cache / package.replace("/", "+")
    exe = prefix / "node_modules" / ".bin" / command
    if not exe.exists():
        try:
            done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package],
                                  capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {package} took over 10 minutes")
        if done.returncode != 0 or not exe.exists():
            pytest.skip(f"npm could not install {package}: {done.stderr[-400:]}")
    return exe
