"""Greedy decoding of the default model through the CUDA kernels in bfloat16 against the NumPy
backend in float32: three chat prompts decoded in one batch, step by step on both.

bfloat16 moves logits by up to about 1.5% of the largest one (measured through the harness), so
two candidates closer than that may swap. The tokens must then be identical, or, from the first
point where they part, explained by such a near-tie: the token the kernels chose scores, in the
float32 logits, within the step's own bfloat16 error of the float32 winner. That error is itself
bounded (4% of the largest logit, as for the tiny model), so a broken kernel cannot explain a
difference away.

Through the CPU harness this runs 12 tokens (the harness is slow: about a second a decode step
for the 30 layers) with the GGUF's blocks dequantized at load, as before they were kept packed:
cuda/dequant_gemv.cu's fibers would take many minutes over 30 layers and a 49k-row head here,
and tests/test_dequant_gemv.py holds those kernels to NumPy. On a GPU, 64 tokens on the packed
weights."""

import numpy as np
import pytest

from model.default import default_model_dir
from model.runner import ModelRunner, Row, StepPlan
from model.tokenizer import Tokenizer
from test_cuda_forward import cuda_ops

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three uses of copper."]
MAX_ERROR = 4e-2


@pytest.mark.slow
@pytest.mark.parametrize("backend,tokens", [("cpu", 12), pytest.param("gpu", 64, marks=pytest.mark.gpu)])
def test_greedy_on_the_default_model_matches_the_cpu_backend(backend, tokens, monkeypatch):
    from model.ops import cuda_quant

    if backend == "cpu":
        monkeypatch.setattr(cuda_quant, "packed", lambda ops, w: None)
    path = default_model_dir()
    tok = Tokenizer(path)
    ops = cuda_ops(backend, "bfloat16")
    blocks = -(-(max(len(tok.encode_chat([{"role": "user", "content": p}])) for p in PROMPTS) + tokens) // 16)
    runners = [ModelRunner.from_dir(path, num_blocks=blocks * len(PROMPTS)),
               ModelRunner.from_dir(path, num_blocks=blocks * len(PROMPTS), ops=ops)]
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(PROMPTS))]
    outputs = [[] for _ in PROMPTS]
    parted: dict[int, str] = {}  # prompt -> how its first difference was explained
    for step in range(tokens):
        live = [i for i in range(len(PROMPTS)) if i not in parted]
        if not live:
            break
        rows = [Row(i, prompts[i] if step == 0 else outputs[i][-1:], 0 if step == 0 else len(prompts[i]) + step - 1,
                    tables[i], sample=True) for i in live]
        want, got = (np.asarray(r.ops.to_host(r.logits(StepPlan(rows)))) for r in runners)
        error = np.abs(got - want).max(axis=1)
        for row, i in enumerate(live):
            assert error[row] < MAX_ERROR * np.abs(want[row]).max(), f"prompt {i}, token {step}: logits too far off"
            best, chosen = int(np.argmax(want[row])), int(np.argmax(got[row]))
            if chosen != best:
                gap = float(want[row, best] - want[row, chosen])
                assert gap <= error[row], (f"prompt {i}, token {step}: the kernels chose {chosen} over {best},"
                                           f" {gap:.3f} apart in float32, more than the bfloat16 error {error[row]:.3f}")
                parted[i] = f"token {step}: {chosen} for {best}, {gap:.3f} apart (bf16 error {error[row]:.3f})"
            outputs[i].append(best)
    print({i: parted.get(i, "identical") for i in range(len(PROMPTS))})
