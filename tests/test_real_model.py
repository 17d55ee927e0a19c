"""The real default model, SmolLM2-135M-Instruct, served from its GGUF in place."""

import importlib.util

import numpy as np
import pytest

from model.default import default_model_dir
from model.runner import ModelRunner, Row, StepPlan
from model.tokenizer import IncrementalDetokenizer, Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol():
    path = default_model_dir()
    return path, ModelRunner.from_dir(path, num_blocks=32), Tokenizer(path)


def test_paris(smol):
    """Greedy chat decoding; this also proves the GGUF q/k rows were un-permuted: without
    that, the first token is <|im_end|>."""
    _, runner, tok = smol
    prompt = tok.encode_chat(QUESTION)
    table = list(range(runner.num_blocks))
    detok = IncrementalDetokenizer(tok, prompt)
    out = runner.step(StepPlan([Row("q", prompt, 0, table, sample=True)]))
    text, tokens = "", []
    while out[0].token_id not in tok.eos_token_ids and len(tokens) < 32:
        tokens.append(out[0].token_id)
        text += detok.add(tokens[-1])
        out = runner.step(StepPlan([Row("q", tokens[-1:], len(prompt) + len(tokens) - 1, table, sample=True)]))
    assert "Paris" in text
    assert len(tokens) < 32  # it stopped on its own end-of-generation token


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")),
                    reason="transformers and torch are not installed (optional parity check)")
def test_logits_match_transformers(smol):
    import torch
    from transformers import AutoModelForCausalLM

    path, runner, tok = smol
    prompt = tok.encode_chat(QUESTION)
    ours = runner.logits(StepPlan([Row("t", prompt, 0, list(range(runner.num_blocks)), sample=True)]))[0]
    in_place = {"gguf_file": "model.gguf"} if (path / "model.gguf").exists() else {}  # else an earlier copy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **in_place)
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0, -1].numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-3
    assert int(np.argmax(ours)) == int(np.argmax(theirs))
