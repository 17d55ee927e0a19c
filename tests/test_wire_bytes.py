"""The bytes every route sends, recorded once (tests/data/wire_bytes.json) and checked on each
run: a refactor of the server must not change what a client reads. After a change to the wire
that is meant, record again on a fresh server and say why in the commit:

    python -m app serve --port 8311 &
    python tools/wire_record.py --url http://127.0.0.1:8311 --out tests/data/wire_bytes.json
"""

import json
import sys
from pathlib import Path

import pytest

from live_server import LiveServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import wire_record  # noqa: E402

RECORDED = ROOT / "tests" / "data" / "wire_bytes.json"


@pytest.fixture(scope="module")
def fresh_server():
    """Its own server: the recording's prefix-cache hits assume nothing was served before."""
    s = LiveServer()
    yield s
    assert s.stop() == 0, s.output()


def test_every_route_sends_the_recorded_bytes(fresh_server):
    recording = wire_record.record(fresh_server.url)
    assert not wire_record.differences(json.loads(RECORDED.read_text()), recording)


def test_a_changed_byte_is_a_difference():
    """The comparison sees one changed character in one case."""
    before = json.loads(RECORDED.read_text())
    after = json.loads(RECORDED.read_text())
    chat = next(c for c in after["http"] if c["name"] == "chat")
    chat["body"] = chat["body"].replace("chat.completion", "chat.completio_", 1)
    assert [line.split(":")[0] for line in wire_record.differences(before, after)] == ["http chat"]
