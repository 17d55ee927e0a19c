"""What a user gets from `pip install .` in a fresh virtual environment, no extras: the `spool`
command, serving the default model. The tracked files are copied out first, so the install
sees what a clone holds and writes no build files into the checkout."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from live_server import free_port, wait_until_ok

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
    done = subprocess.run([str(tmp / "venv" / "bin" / "pip"), "install", "--disable-pip-version-check", "-q",
                           str(source)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "venv" / "bin"


def test_the_install_has_the_command_and_no_test_tooling(venv):
    listed = subprocess.run([str(venv / "pip"), "list", "--format=freeze"], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert "spool-llm" in names and (venv / "spool").is_file()
    assert not names & {"pytest", "playwright", "openai", "schemathesis", "matplotlib"}
    done = subprocess.run([str(venv / "spool"), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["spool", "0.1.0"], done.stderr


def test_spool_serve_answers_health_on_the_default_model(venv, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(venv / "spool"), "serve", "--port", str(port), "--max-num-seqs", "8", "-t", "2"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_until_ok(f"http://127.0.0.1:{port}/health", proc, timeout=600), (tmp_path / "serve.log").read_text()
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        where = subprocess.run([str(venv / "python"), "-c", "import app; print(app.__file__)"], cwd=tmp_path,
                               capture_output=True, text=True, env=env).stdout
        assert str(venv.parent) in where  # the installed copy served, not the checkout
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()


def test_print_config_in_the_installed_command(venv, tmp_path):
    done = subprocess.run([str(venv / "spool"), "serve", "--max-num-seqs", "8", "-t", "2", "--print-config"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPOOL_PORT": "8123"})
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if not line.startswith("#")}
    assert rows["--max-num-seqs"] == ["8", "command", "line"] and rows["--threads"] == ["2", "command", "line"]
    assert rows["--port"] == ["8123", "SPOOL_PORT"] and rows["--host"] == ["127.0.0.1", "default"]
