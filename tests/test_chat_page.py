"""The chat page at GET /: served by Spool itself, driven in headless Chromium (Debian's
chromium package, through Playwright pointed at it; nothing downloads a browser) against a live
server on the default model; and a page of another origin, which may drive the server only when
--allowed-origins names it."""

import base64
import http.server
import json
import re
import shutil
import threading

import httpx
import pytest
import trio
from trio_websocket import HandshakeError, open_websocket_url

from live_server import LiveServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "sekret-key"


# --- the page over plain HTTP and WebSocket ---------------------------------------------------

def test_the_page_and_its_files_are_served_with_a_strict_policy(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert '<script src="/ui/chat.js">' in page.text
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        reply = httpx.get(f"{server.url}/ui/{name}")
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
    missing = httpx.get(server.url + "/ui/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    info = httpx.get(server.url + "/metrics").text
    assert 'spool:server_info{backend="cpu (q8_0)",model_name="SmolLM2-135M-Instruct"} 1.0' in info


def test_the_page_stays_small():
    from importlib.resources import files

    script = (files("app.server") / "ui" / "chat.js").read_text()
    assert len(script.splitlines()) < 400
    assert "innerHTML" not in script  # model output only ever becomes text


@pytest.fixture(scope="module")
def keyed_server():
    s = LiveServer("--api-key", KEY, "--no-ui", "--kv-cache-gib", "0.05")
    yield s
    s.stop()


async def test_a_websocket_may_carry_the_key_as_a_subprotocol(keyed_server):
    url = keyed_server.url.replace("http", "ws") + "/v1/ws"
    token = base64.urlsafe_b64encode(KEY.encode()).rstrip(b"=").decode()
    for protocols in ([], ["spool"], ["spool", "spool.bearer." + base64.urlsafe_b64encode(b"wrong").decode()]):
        with pytest.raises(HandshakeError):
            async with open_websocket_url(url, subprotocols=protocols):
                pass
    async with open_websocket_url(url, subprotocols=["spool", f"spool.bearer.{token}"]) as ws:
        assert ws.subprotocol == "spool"
        await ws.send_message('{"type": "generate", "id": "a", "prompt": "Hi", "max_tokens": 2}')
        with trio.fail_after(60):
            while (frame := await ws.get_message()) and '"done"' not in frame:
                assert '"error"' not in frame
    async with open_websocket_url(url, extra_headers=[("Authorization", f"Bearer {KEY}")]) as ws:
        assert ws.subprotocol is None  # none offered, none chosen: clients as before


def test_no_ui_turns_the_page_off(keyed_server):
    assert httpx.get(keyed_server.url + "/").status_code == 401  # no page route: the key guard answers
    assert httpx.get(keyed_server.url + "/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


# --- in the browser ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (Debian's chromium package; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def expect(locator):
    from playwright.sync_api import expect as playwright_expect  # its waits run under the page's CSP

    return playwright_expect(locator)


def open_page(browser, url):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def last(page, selector):
    return page.locator(selector).last


@pytest.mark.slow
def test_chat_stop_compare_and_errors_in_a_real_browser(browser, server, tmp_path):
    page, errors = open_page(browser, server.url)
    page.wait_for_selector("#status.ok", timeout=30_000)
    assert page.inner_text("#model") == "SmolLM2-135M-Instruct"
    expect(page.locator("#backend")).to_contain_text("cpu")
    assert "running 0" in page.inner_text("#load")

    # a message, and its answer streamed in
    page.fill("#temperature", "0")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    page.wait_for_selector(".answer.done", timeout=60_000)
    assert "Paris" in last(page, ".answer .text").inner_text()
    stats = last(page, ".answer .stats").inner_text()
    assert "first token" in stats and "tokens" in stats and "stop" in stats

    # a long answer, stopped: the partial text stays, and the server lets go of everything. The
    # greedy answer to this prompt runs to max_tokens in float32, Q8_0 and Q4_1 alike (one that
    # counts one number per line ends after 20, which a fast machine finishes before the click)
    page.fill("#max_tokens", "1500")
    page.fill("#prompt", "Write the numbers from 1 to 1000, separated by commas.")
    page.press("#prompt", "Enter")
    expect(page.locator(".answer").nth(1).locator(".text")).to_have_text(re.compile(r"[\s\S]{30}"), timeout=60_000)
    last(page, ".answer .stop").click()
    page.wait_for_selector(".answer.stopped", timeout=30_000)
    partial = last(page, ".answer .text").inner_text()
    assert len(partial) > 30 and "stopped" in last(page, ".answer .stats").inner_text()
    server.wait_gauge("num_requests_running", 0)
    server.wait_gauge("kv_cache_usage_perc", 0)
    assert last(page, ".answer .text").inner_text() == partial  # nothing more arrived

    # compare: two answers to one prompt on the same socket, each with its own Stop
    page.fill("#max_tokens", "40")
    page.fill("#prompt", "Name three fruits.")
    page.click("#compare")
    expect(page.locator(".compare .answer.done")).to_have_count(2, timeout=90_000)
    answers = page.locator(".compare .answer")
    assert answers.count() == 2 and all(answers.nth(i).locator(".text").inner_text() for i in range(2))
    assert page.locator(".compare .answer .setting").all_inner_texts() == ["temperature 0", "temperature 1"]

    # a request the server refuses shows its message
    page.fill("#max_tokens", "0")
    page.fill("#prompt", "Hello")
    page.click("#send")
    page.wait_for_selector(".answer.failed .error", timeout=30_000)
    assert "max_tokens" in last(page, ".answer .error").inner_text()

    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert errors == []


@pytest.mark.slow
def test_the_page_asks_for_the_key_and_keeps_it(browser):
    server = LiveServer("--api-key", KEY, "--kv-cache-gib", "0.05")
    try:
        page, errors = open_page(browser, server.url)
        page.wait_for_selector("#keyform:not([hidden])", timeout=30_000)
        refused = page.evaluate("""() => new Promise((done) => {
            const ws = new WebSocket(`ws://${location.host}/v1/ws`, ["spool"]);
            ws.onopen = () => done("open");
            ws.onclose = () => done("refused");
        })""")
        assert refused == "refused"
        assert page.inner_text("#status") == "offline"

        page.fill("#key", KEY)
        page.click("#keyform button")
        page.wait_for_selector("#status.ok", timeout=30_000)
        page.fill("#prompt", "Say hi.")
        page.click("#send")
        page.wait_for_selector(".answer.done", timeout=60_000)
        assert last(page, ".answer .text").inner_text()
        assert page.evaluate("localStorage.getItem('spool-api-key')") == KEY

        page.reload()  # the key is remembered for this origin
        page.wait_for_selector("#status.ok", timeout=30_000)
        assert page.locator("#keyform").is_hidden()

        # the server goes away: the page says so, and reconnects when it is back
        assert server.stop() == 0
        expect(page.locator("#banner")).to_contain_text("trying again", timeout=30_000)
        assert page.inner_text("#status") == "offline"
        server = LiveServer("--api-key", KEY, "--kv-cache-gib", "0.05", port=server.port)
        page.wait_for_selector("#status.ok", timeout=60_000)
        expect(page.locator("#banner")).to_be_hidden()
        page.fill("#prompt", "Say hi again.")
        page.click("#send")
        expect(page.locator(".answer.done")).to_have_count(1, timeout=60_000)  # a new page since the reload
        assert errors == []
    finally:
        server.stop()


# --- a page of another origin ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_origin():
    """A real second server on another port: a page from it carries its own Origin."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!doctype html><title>another site</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_port}"
    site.shutdown()
    site.server_close()


# From the other page: a WebSocket that generates, a text/plain POST (a "simple" request: no
# preflight) and a JSON one (preflighted). A status, or "blocked" where the browser refused.
DRIVE = """async (spool) => {
    const socket = await new Promise((done) => {
        const ws = new WebSocket(spool.replace("http", "ws") + "/v1/ws");
        ws.onopen = () => ws.send(JSON.stringify({type: "generate", id: "a", prompt: "Hi", max_tokens: 2}));
        ws.onmessage = (e) => { if (JSON.parse(e.data).type === "done") { ws.close(); done("generated"); } };
        ws.onerror = () => done("refused");
    });
    const body = JSON.stringify({prompt: "Hello", max_tokens: 2});
    const post = (type) => fetch(spool + "/v1/completions", {method: "POST", headers: {"Content-Type": type}, body})
        .then((r) => r.status, () => "blocked");
    return {socket, simple: await post("text/plain"), json: await post("application/json")};
}"""


def prompt_tokens(server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("spool:prompt_tokens_total"))


def request_lines(server, since: int, method: str) -> list[str]:
    return [line for line in server.output()[since:].splitlines() if f" {method} /v1/completions " in line]


@pytest.mark.slow
def test_a_page_of_another_origin_cannot_drive_the_server(browser, server, other_origin):
    page, _ = open_page(browser, other_origin + "/")
    tokens, since = prompt_tokens(server), len(server.output())
    assert page.evaluate(DRIVE, server.url) == {"socket": "refused", "simple": "blocked", "json": "blocked"}
    assert prompt_tokens(server) == tokens  # nothing reached the engine
    (simple,) = request_lines(server, since, "POST")  # sent without asking, and refused
    assert " 403 " in simple
    (preflight,) = request_lines(server, since, "OPTIONS")  # the JSON one never left the browser
    assert " 403 " in preflight

    # the server's own page still drives it
    own, errors = open_page(browser, server.url)
    own.wait_for_selector("#status.ok", timeout=30_000)
    assert errors == []


@pytest.mark.slow
def test_allowed_origins_let_that_page_drive_the_server(browser, other_origin):
    server = LiveServer("--allowed-origins", json.dumps([other_origin]), "--kv-cache-gib", "0.05")
    try:
        page, errors = open_page(browser, other_origin + "/")
        tokens = prompt_tokens(server)
        # text/plain now reaches the server, which reads it as no JSON: the page sees why
        assert page.evaluate(DRIVE, server.url) == {"socket": "generated", "simple": 415, "json": 200}
        assert prompt_tokens(server) > tokens and errors == []

        own, errors = open_page(browser, server.url)  # and the server's own page as before
        own.wait_for_selector("#status.ok", timeout=30_000)
        own.fill("#prompt", "Say hi.")
        own.click("#send")
        own.wait_for_selector(".answer.done", timeout=60_000)
        assert last(own, ".answer .text").inner_text() and errors == []
    finally:
        server.stop()
