"""--generation-config and --override-generation-config, as vLLM takes them: the sampling a
model's generation_config.json recommends is what a request that leaves the fields out gets;
"vllm" turns it off; what a request sends always wins."""

import json
import shutil

import pytest

from app.server.generation_config import sampling_defaults
from app.server.prompts import generation_params
from app.server.schemas import ChatCompletionRequest, CompletionRequest

RECOMMENDED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
               "bos_token_id": 1, "eos_token_id": [2, 3]}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return tmp_path


def test_auto_reads_the_models_file_and_the_override_goes_over_it(model_dir, tmp_path_factory):
    assert sampling_defaults("auto", model_dir, None) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                          "repetition_penalty": 1.05}
    assert sampling_defaults("vllm", model_dir, None) == {}
    assert sampling_defaults("vllm", model_dir, '{"temperature": 0.6, "max_new_tokens": 64}') == \
        {"temperature": 0.6, "max_new_tokens": 64}
    assert sampling_defaults(str(model_dir), tmp_path_factory.mktemp("other"), '{"top_k": 5}')["top_k"] == 5
    assert sampling_defaults("auto", tmp_path_factory.mktemp("none"), None) == {}  # a model without the file


@pytest.mark.parametrize("source, override, says", [
    ("/no/such/folder", None, "is not a folder with a generation_config.json"),
    ("vllm", "[1]", "must be a JSON object"),
    ("vllm", "{", "is not JSON"),
    ("vllm", '{"top_k": 2.5}', "top_k in the generation config must be a number (whole)"),
    ("vllm", '{"temperature": "hot"}', "temperature in the generation config must be a number"),
])
def test_a_bad_config_is_one_line(source, override, says, tmp_path):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
        sampling_defaults(source, tmp_path, override)
    assert "\n" not in str(e.value)


def test_a_request_that_leaves_fields_out_gets_the_defaults(model_dir):
    defaults = sampling_defaults("auto", model_dir, '{"max_new_tokens": 40}')
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    params = generation_params(chat, 0, defaults=defaults)
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, params.max_tokens) == (0.7, 0.8, 20, 1.05, 40)
    sent = CompletionRequest(model="m", prompt="hi", temperature=0.0, top_k=-1, max_tokens=3)
    params = generation_params(sent, 0, defaults=defaults)  # what a request sends wins
    assert (params.sampling.temperature, params.sampling.top_k, params.sampling.top_p, params.max_tokens) == \
        (0.0, -1, 0.8, 3)
    plain = generation_params(CompletionRequest(model="m", prompt="hi"), 0)
    assert (plain.sampling.temperature, plain.sampling.top_k, plain.max_tokens) == (1.0, 0, 16)  # OpenAI's


def test_a_server_applies_the_models_config_unless_told_vllm(tiny_dir, tmp_path):
    """A greedy, five-token generation config: a completion that sends neither gets the greedy
    five tokens; with --generation-config vllm, OpenAI's 16 sampled ones."""
    from live_server import LiveServer

    model = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                              "bos_token_id": 1, "eos_token_id": 2}))
    got = {}
    for flags in ((), ("--generation-config", "vllm")):
        server = LiveServer(str(model), "--kv-cache-gib", "0.05", *flags)
        try:
            with server.openai_client() as client:
                ask = lambda **kw: client.completions.create(model="tiny", prompt="Once upon a time", seed=3, **kw)  # noqa: E731
                got[flags] = (ask(), ask(temperature=0.0, max_tokens=5))
        finally:
            assert server.stop() == 0, server.output()
    (left_out, greedy), (openai_defaults, _) = got[()], got[("--generation-config", "vllm")]
    assert left_out.usage.completion_tokens == 5 and left_out.choices[0].text == greedy.choices[0].text
    assert openai_defaults.usage.completion_tokens == 16
