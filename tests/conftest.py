import pytest

from live_server import LiveServer
from tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_variant_dir(tmp_path_factory):
    """make(variant, tie) -> a directory, built once per combination."""
    built = {}

    def make(variant: str, tie: bool = True):
        key = (variant, tie)
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{variant}"), variant, tie)
        return built[key]

    return make


@pytest.fixture(scope="module")
def server():
    """The default model served for one test module (a module may define its own), with room for
    20 clients at n=2 at once."""
    s = LiveServer("--kv-cache-gib", "0.25", "--max-seqs", "48")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client, pointed at this module's server."""
    with server.openai_client(timeout=300) as c:
        yield c
