"""HTTPS from --ssl-certfile and --ssl-keyfile (vLLM's names; llama-server's --ssl-cert-file and
--ssl-key-file): the official client over TLS, a WebSocket over wss, a plain-HTTP client turned
away without harm to the server, and a bad key file refused at start in one line."""

import json
import shutil
import ssl
import subprocess
import sys

import httpx
import pytest

from live_server import ROOT, LiveServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def trust(certificate):
    """A client's TLS context that trusts the certificate."""
    return ssl.create_default_context(cafile=str(certificate[0]))


@pytest.fixture(scope="module")
def tls_server(tiny_dir, certificate, trust):
    cert, key = certificate
    server = LiveServer(str(tiny_dir), "--kv-cache-gib", "0.05", "--ssl-cert-file", str(cert), "--ssl-keyfile", str(key),
                        scheme="https", verify=trust)
    yield server
    assert server.stop() == 0, server.output()


def test_the_official_client_talks_over_tls(tls_server, tiny_dir, trust):
    import openai

    with openai.OpenAI(base_url=tls_server.url + "/v1", api_key="unused", max_retries=0,
                       http_client=httpx.Client(verify=trust)) as client:
        reply = client.completions.create(model=tiny_dir.name, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 8
    assert "https://127.0.0.1" in tls_server.output()


async def test_a_websocket_runs_over_wss(tls_server, trust):
    import trio
    from trio_websocket import open_websocket_url

    async with open_websocket_url(tls_server.url.replace("https", "wss") + "/v1/ws", ssl_context=trust) as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "a", "prompt": "Hello", "max_tokens": 4}))
        with trio.fail_after(60):
            while (frame := json.loads(await ws.get_message()))["type"] != "done":
                assert frame["type"] == "delta", frame
    assert frame["choices"][0]["finish_reason"] == "length"


def test_plain_http_and_a_broken_handshake_harm_no_one(tls_server, trust):
    import socket

    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_server.url.replace("https", "http") + "/health", timeout=5)
    with socket.create_connection(("127.0.0.1", tls_server.port)) as s:  # half a ClientHello, then gone
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    assert httpx.get(tls_server.url + "/health", verify=trust, timeout=10).status_code == 200


def test_a_bad_key_is_refused_at_start_in_one_line(tiny_dir, certificate, tmp_path):
    (tmp_path / "bad.pem").write_text("not a key\n")
    done = subprocess.run([sys.executable, "-m", "app", "serve", str(tiny_dir), "--ssl-certfile", str(certificate[0]),
                           "--ssl-keyfile", str(tmp_path / "bad.pem")], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: --ssl-certfile"), done.stderr
