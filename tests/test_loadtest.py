"""tools/loadtest.py: its arithmetic on a synthetic trace with known answers (vLLM's
definitions), and short runs against a live Spool over SSE and over the WebSocket."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import loadtest  # noqa: E402
from loadtest import RequestResult, summarize  # noqa: E402


def trace() -> list[RequestResult]:
    return [
        RequestResult(ok=True, prompt_len=10, output_len=11, ttft=0.1, latency=1.1, itl=[0.1] * 10),
        RequestResult(ok=True, prompt_len=20, output_len=4, ttft=0.3, latency=0.9, itl=[0.2] * 3),
        RequestResult(ok=True, prompt_len=30, output_len=1, ttft=0.2, latency=0.2),
        RequestResult(error="http_429"),
        RequestResult(error="timeout"),
    ]


def test_the_statistics_of_a_known_trace():
    s = summarize(trace(), duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (3, 2, {"http_429": 1, "timeout": 1})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 16)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 8.0 and s["total_token_throughput"] == 38.0
    assert s["goodput"] is None  # no SLO given
    # TTFT over the three that completed: 100, 300, 200 ms
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["ttft_ms"]["p90"] == pytest.approx(280)  # linear: 200 + 0.8 * (300 - 200)
    # TPOT: (1.1 - 0.1) / 10 = 100 ms and (0.9 - 0.3) / 3 = 200 ms; the one-token request has none
    assert s["tpot_ms"]["mean"] == pytest.approx(150) and s["tpot_ms"]["p99"] == pytest.approx(199)
    # ITL pooled over requests: ten gaps of 100 ms and three of 200 ms
    assert s["itl_ms"]["mean"] == pytest.approx(1600 / 13) and s["itl_ms"]["median"] == pytest.approx(100)
    assert s["e2el_ms"]["p99"] == pytest.approx(900 + 0.98 * 200)


@pytest.mark.parametrize("slo,goodput", [({"ttft": 250, "tpot": 150}, 1.0),  # the first and the one-token one
                                         ({"ttft": 250, "tpot": 150, "e2el": 1000}, 0.5),
                                         ({"tpot": 250}, 1.5), ({"ttft": 50}, 0.0)])
def test_goodput_counts_requests_that_meet_every_slo(slo, goodput):
    assert summarize(trace(), 2.0, slo)["goodput"] == pytest.approx(goodput)


def test_percentiles_interpolate_as_numpy_does():
    d = loadtest.distribution([v / 1000 for v in range(1, 101)])  # 1 .. 100 ms
    assert d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01) and d["median"] == pytest.approx(50.5)
    assert loadtest.distribution([])["mean"] == 0.0


def test_arrivals_lengths_slo_and_metrics_parsing():
    gaps = loadtest.poisson_delays(20000, 4.0, random.Random(1))
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03) and min(gaps) >= 0
    assert loadtest.poisson_delays(3, math.inf, random.Random(1)) == [0.0, 0.0, 0.0]
    lengths = loadtest.input_lengths(2000, 100, 0.2, random.Random(2))
    assert min(lengths) == 80 and max(lengths) == 120
    assert loadtest.parse_slo("ttft:500, tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="unknown metric"):
        loadtest.parse_slo("latency:3")
    page = ('# HELP spool:num_requests_running x\nspool:num_requests_running{model_name="m"} 3.0\n'
            'spool:num_requests_waiting{model_name="m"} 2.0\nvllm:num_requests_running{engine="0"} 4\n'
            'llamacpp:requests_deferred 1\nspool:num_requests_running_total 9\n')
    assert loadtest.parse_metrics(page) == {"running": 7.0, "waiting": 3.0}


def test_a_remote_target_is_refused_without_allow_remote():
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000"):
        loadtest.check_target(url, allow_remote=False)
    with pytest.raises(SystemExit, match="--allow-remote"):
        loadtest.check_target("http://10.1.2.3:8000", allow_remote=False)
    loadtest.check_target("http://10.1.2.3:8000", allow_remote=True)


@pytest.fixture(scope="module")
def server():
    from live_server import LiveServer

    s = LiveServer("--kv-cache-gib", "0.2", "--max-seqs", "8")
    yield s
    s.stop()


@pytest.mark.parametrize("protocol,endpoint,extra", [("sse", "completions", ["--keep-alive"]),  # httpx
                                                     ("sse", "chat", []),  # tools/sse_stream.py
                                                     ("sse", "completions", ["--no-stream"]),
                                                     ("ws", "chat", ["--request-rate", "20"])])
def test_a_short_load_test_against_a_live_server(server, tmp_path, protocol, endpoint, extra):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    done = subprocess.run([sys.executable, "tools/loadtest.py", "--base-url", server.url, "--num-requests", "12",
                           "--max-concurrency", "4", "--input-len", "40", "--range-ratio", "0.25", "--output-len", "6",
                           "--ignore-eos", "--protocol", protocol, "--endpoint", endpoint, "--slo", "ttft:60000",
                           "--json", str(out), "--plot", str(png), "--quiet", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Successful requests" in done.stdout
    report = json.loads(out.read_text())
    s = report["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (12, 12, 0, {})
    assert len(report["requests"]) == 12 and report["config"]["model"] == "SmolLM2-135M-Instruct"
    for r in report["requests"]:
        assert r["ok"] and r["output_len"] == r["max_tokens"] and 0 < r["ttft"] <= r["latency"]
        assert len(r["itl"]) >= (0 if "--no-stream" in extra else 1) and 4 <= r["max_tokens"] <= 7  # 6, +-25%
        assert r["prompt_len"] >= (30 if endpoint == "completions" else 40)  # chat adds its template
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request met a 60 s TTFT
    assert report["timeline"] and {"running", "waiting"} <= set(report["timeline"][0])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    server.wait_gauge("num_requests_running", 0)


def test_an_unreachable_or_remote_server_is_one_line():
    from live_server import free_port

    for url in (f"http://127.0.0.1:{free_port()}", "http://10.1.2.3:8000"):
        done = subprocess.run([sys.executable, "tools/loadtest.py", "--base-url", url, "--quiet"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr


def test_a_dataset_run_bounded_by_duration(server, tmp_path):
    """--dataset rows (a prompt, or chat messages, each with its own output_len) sent as Poisson
    arrivals until --duration ends: every request that started before the end completes."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "The capital of France is", "output_len": 3},
        {"messages": [{"role": "user", "content": "Say hi."}], "output_len": 5}]) + "\n\n")  # a blank line too
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "tools/loadtest.py", "--base-url", server.url, "--dataset", str(data),
                           "--endpoint", "chat", "--ignore-eos", "--duration", "2", "--request-rate", "8",
                           "--max-concurrency", "4", "--json", str(out), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    s, requests = report["summary"], report["requests"]
    assert s["failed"] == 0 and s["completed"] == len(requests) >= 4
    assert all(r["start"] < 2.0 for r in requests)
    assert sorted({r["max_tokens"] for r in requests}) == [3, 5]
    assert all(r["output_len"] == r["max_tokens"] for r in requests)

    data.write_text('{"prompt": "x"}\nnot json\n')
    bad = subprocess.run([sys.executable, "tools/loadtest.py", "--base-url", server.url, "--dataset", str(data),
                          "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().startswith(f"error: {data}:2:"), bad.stderr
