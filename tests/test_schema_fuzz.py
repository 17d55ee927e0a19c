"""Schemathesis against the published /openapi.json: hundreds of generated requests per route
(its coverage and fuzzing phases), and not one 5xx, nor one response that breaks the schema
or its content type. The tiny model with a 128-token context keeps each valid generation short."""

import shutil
import subprocess

import pytest

from live_server import LiveServer

SCHEMATHESIS = shutil.which("schemathesis")


@pytest.mark.slow
@pytest.mark.skipif(SCHEMATHESIS is None, reason="schemathesis is not installed (pip install -e '.[dev]')")
def test_no_generated_request_gets_a_5xx_or_breaks_the_schema(tiny_dir, tmp_path):
    server = LiveServer("--model", str(tiny_dir), "--max-model-len", "128", "--kv-cache-gib", "0.05")
    try:
        done = subprocess.run([SCHEMATHESIS, "run", server.url + "/openapi.json",
                               "--checks", "not_a_server_error,response_schema_conformance,content_type_conformance",
                               "--max-examples", "100", "--generation-deterministic", "--request-timeout", "60",
                               "--report", "junit", "--report-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=1200, cwd=tmp_path)
        summary = done.stdout[-3000:]
        assert done.returncode == 0, summary
        assert " passed" in summary and "generated" in summary
        server.assert_serving()
    finally:
        server.stop()
