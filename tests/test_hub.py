"""Models by Hub id (model/hub.py) against a fake Hub on 127.0.0.1 (tests/fake_hub.py), through
huggingface_hub itself: HF_ENDPOINT points at the fake, HF_HOME at a fresh directory."""

import importlib

import gguf
import httpx
import pytest
from huggingface_hub import constants

from fake_hub import FakeHub
from live_server import LiveServer, free_port
from model.default import resolve_model
from model.errors import ModelError
from model.hub import is_hub_id, resolve_hub
from tiny_gguf import tiny_gguf

SPOOL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
DECOYS = {  # in the safetensors repository, never fetched
    "pytorch_model.bin": b"pickle", "onnx/model.onnx": b"onnx", "original/consolidated.safetensors": b"meta",
    "tiny-Q8_0.gguf": b"GGUF", "README.md": b"# tiny", ".gitattributes": b"*.bin filter=lfs",
}
TOKEN = "hf_let_me_in"


@pytest.fixture(scope="module")
def repos(tiny_dir, tmp_path_factory):
    """repo id -> {file: bytes}: a safetensors checkpoint, a GGUF repository with two quants, a
    split GGUF, and a gated copy of the checkpoint."""
    d = tmp_path_factory.mktemp("hub-files")
    q8, _, _ = tiny_gguf(d / "tiny.Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    f32, _, _ = tiny_gguf(d / "tiny.F32.gguf")
    checkpoint = {name: (tiny_dir / name).read_bytes() for name in SPOOL_FILES}
    return {
        "acme/tiny": checkpoint | DECOYS,
        "acme/tiny-GGUF": {"tiny.Q8_0.gguf": q8.read_bytes(), "tiny.F32.gguf": f32.read_bytes(),
                           "mmproj-tiny-F16.gguf": b"projector", "README.md": b"# quants"},
        "acme/big-GGUF": {"big-Q8_0-00001-of-00002.gguf": b"GGUF1", "big-Q8_0-00002-of-00002.gguf": b"GGUF2"},
        "acme/gated": checkpoint,
    }


@pytest.fixture(scope="module")
def module_hub(repos):
    with FakeHub() as hub:
        for repo_id, files in repos.items():
            hub.add(repo_id, files, token=TOKEN if repo_id == "acme/gated" else None)
        yield hub


@pytest.fixture
def env(tmp_path):
    """set(**variables): the environment huggingface_hub reads, its import-time constants re-read;
    all restored after the test."""
    with pytest.MonkeyPatch.context() as mp:
        def set_env(**variables):
            for key, value in variables.items():
                mp.setenv(key, value) if value is not None else mp.delenv(key, raising=False)
            importlib.reload(constants)

        set_env(HF_HOME=str(tmp_path / "hf"), SPOOL_CACHE_DIR=str(tmp_path / "spool"), HF_HUB_CACHE=None,
                HF_TOKEN=None, HUGGING_FACE_HUB_TOKEN=None, HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None)
        yield set_env
    importlib.reload(constants)


@pytest.fixture
def hub(module_hub, env):
    module_hub.requests.clear()
    env(HF_ENDPOINT=module_hub.url)
    return module_hub


def error_of(spec, **kw) -> str:
    with pytest.raises(ModelError) as e:
        resolve_model(spec, progress=False, **kw)
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "local").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert is_hub_id("models/missing")  # a relative directory that is not there is taken as an id, as vLLM does
    assert not is_hub_id("models/local")
    for spec in ("./a/b", "/a/b", "a/b/c", "gpt2", "a/b.gguf", "~/x", "a/b:"):
        assert not is_hub_id(spec), spec


def test_a_safetensors_id_fetches_only_what_spool_reads(hub, repos, tmp_path):
    path = resolve_model("acme/tiny", progress=False)
    assert path.parent.parent == tmp_path / "hf" / "hub" / "models--acme--tiny"  # huggingface_hub's cache
    assert {p.name for p in path.iterdir()} == SPOOL_FILES
    for name in SPOOL_FILES:
        assert (path / name).read_bytes() == repos["acme/tiny"][name], name
    assert hub.resolved("acme/tiny") == SPOOL_FILES
    assert resolve_model("acme/tiny", progress=False) == path  # the second time from the cache


def test_download_dir_is_the_cache(hub, tmp_path):
    path = resolve_model("acme/tiny", progress=False, download_dir=str(tmp_path / "models"))
    assert path.is_relative_to(tmp_path / "models" / "models--acme--tiny")
    assert not (tmp_path / "hf" / "hub" / "models--acme--tiny").exists()


def test_serve_a_hub_id(module_hub, tmp_path):
    """`spool serve Org/Name` end to end: fetched, loaded, named by its id, answering a chat."""
    env = {"HF_ENDPOINT": module_hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "SPOOL_CACHE_DIR": str(tmp_path / "spool")}
    server = LiveServer("--model", "acme/tiny", "--backend", "numpy", "--kv-cache-gib", "0.02", env=env)
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["acme/tiny"]
        with server.openai_client() as client:
            reply = client.chat.completions.create(
                model="acme/tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        assert "Fetching acme/tiny from " + module_hub.url in server.output()
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("spec", ["acme/tiny-GGUF:Q8_0", "acme/tiny-GGUF:q8_0"])
def test_a_quant_tag_fetches_that_gguf_alone(hub, repos, spec):
    path = resolve_model(spec, progress=False)
    assert (path / "config.json").is_file()  # the GGUF went through Spool's own conversion
    assert (path / "model.gguf").resolve().read_bytes() == repos["acme/tiny-GGUF"]["tiny.Q8_0.gguf"]
    assert hub.resolved("acme/tiny-GGUF") == {"tiny.Q8_0.gguf"}


def test_gguf_file_names_the_file(hub, repos):
    path = resolve_hub("acme/tiny-GGUF", gguf_file="tiny.F32.gguf", progress=False)
    assert path.name == "tiny.F32.gguf" and path.read_bytes() == repos["acme/tiny-GGUF"]["tiny.F32.gguf"]
    assert hub.resolved("acme/tiny-GGUF") == {"tiny.F32.gguf"}


@pytest.mark.parametrize("spec, kw, words", [
    ("acme/tiny-GGUF", {}, ["2 GGUF files", "tiny.Q8_0.gguf", "tiny.F32.gguf", "acme/tiny-GGUF:QUANT"]),
    ("acme/tiny-GGUF:Q4_K", {}, ["no GGUF file tagged Q4_K", "tiny.Q8_0.gguf, tiny.F32.gguf"]),
    ("acme/tiny-GGUF", {"gguf_file": "tiny.Q2_K.gguf"}, ["no file tiny.Q2_K.gguf", "tiny.Q8_0.gguf"]),
    ("acme/big-GGUF:Q8_0", {}, ["split GGUF", "2 parts", "llama-gguf-split --merge"]),
    ("acme/gated:Q8_0", {}, ["safetensors checkpoint", "serve it as acme/gated"]),  # its listing is public
])
def test_a_gguf_that_cannot_be_picked_is_one_line(hub, spec, kw, words):
    message = error_of(spec, **kw)
    assert all(w in message for w in words), message
    assert "mmproj" not in message
    assert not hub.resolved(spec.split(":")[0])  # nothing was fetched


def test_offline_resolves_from_the_cache(repos, env, tmp_path):
    with FakeHub() as hub:
        hub.add("acme/tiny", repos["acme/tiny"])
        hub.add("acme/tiny-GGUF", repos["acme/tiny-GGUF"])
        env(HF_ENDPOINT=hub.url)
        online = resolve_model("acme/tiny", progress=False), resolve_model("acme/tiny-GGUF:Q8_0", progress=False)
    env(HF_HUB_OFFLINE="1")  # and the Hub is gone
    assert (resolve_model("acme/tiny", progress=False), resolve_model("acme/tiny-GGUF:Q8_0", progress=False)) == online
    assert resolve_model("acme/tiny-GGUF", progress=False) == online[1]  # the one GGUF in the cache
    for spec in ("acme/never", "acme/tiny-GGUF:F32"):
        message = error_of(spec)
        assert "HF_HUB_OFFLINE" in message and "cache" in message, message


def test_a_missing_repository_is_one_line(hub):
    message = error_of("acme/nothing")
    assert "no model acme/nothing on " + hub.url in message and "HF_TOKEN" in message, message


def test_a_gated_repository_asks_for_hf_token(hub, env):
    message = error_of("acme/gated")
    assert "gated" in message and "HF_TOKEN" in message and "401" in message, message
    env(HF_TOKEN=TOKEN)
    assert {p.name for p in resolve_model("acme/gated", progress=False).iterdir()} == SPOOL_FILES


def test_no_network_is_one_line(env):
    env(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    message = error_of("acme/tiny")
    assert "cannot reach http://127.0.0.1:" in message and "HF_HUB_OFFLINE=1" in message, message


def test_a_missing_local_path_is_still_a_local_error(hub):
    message = error_of("./acme/tiny")
    assert "does not exist" in message and not hub.requests
