"""The bytes every route sends, recorded once per CPU path (tests/data/wire_bytes/PATH.json: its
kernels' logprobs and embeddings are that path's own) and checked on each run: a refactor of the
server must not change what a client reads. After a change to the wire that is meant, record
again on a fresh server, on each path at hand, and say why in the commit:

    python -m app serve --port 8311 &
    python tools/wire_record.py --url http://127.0.0.1:8311 --out tests/data/wire_bytes/PATH.json

PATH is wire_record.cpu_path(); on a path with no recording the check skips and names it.
"""

import json
import sys
from pathlib import Path

import pytest

from live_server import LiveServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import wire_record  # noqa: E402

RECORDINGS = ROOT / "tests" / "data" / "wire_bytes"
RECORDED = RECORDINGS / f"{wire_record.cpu_path()}.json"


@pytest.fixture(scope="module")
def fresh_server():
    """Its own server: the recording's prefix-cache hits assume nothing was served before."""
    s = LiveServer()
    yield s
    assert s.stop() == 0, s.output()


@pytest.mark.skipif(not RECORDED.exists(), reason=f"no recording for this CPU path: {RECORDED.name}")
def test_every_route_sends_the_recorded_bytes(fresh_server):
    recording = wire_record.record(fresh_server.url)
    assert not wire_record.differences(json.loads(RECORDED.read_text()), recording)


def test_a_changed_byte_is_a_difference():
    """The comparison sees one changed character in one case."""
    any_recording = sorted(RECORDINGS.glob("*.json"))[0]
    before = json.loads(any_recording.read_text())
    after = json.loads(any_recording.read_text())
    chat = next(c for c in after["http"] if c["name"] == "chat")
    chat["body"] = chat["body"].replace("chat.completion", "chat.completio_", 1)
    assert [line.split(":")[0] for line in wire_record.differences(before, after)] == ["http chat"]
