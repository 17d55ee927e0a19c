"""Prompt logprobs through the engine on the tiny model (NumPy, numba and CUDA backends): a prefill
chunk scores every prompt position, and the scores equal what sampling reads one prefix at a
time, however the prompt is chunked and whatever the prefix cache holds."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher, gpu_available
from engine_harness import Harness
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

TEXT = "Hello world! 9 8 7 6 5 4 3 2 1 0. The capital of Rome is Italy, naïve Paris."
TOLERANCE = 1e-5  # nats; measured: 1.4e-6 on NumPy (chunk shapes differ), 0 on numba (rows are batch-invariant)


def backend(name: str):
    if name == "numpy":
        return NumpyOps()
    if name == "numba-q8_0":
        return NumbaOps("q8_0")
    if name == "cuda-harness":  # the .cu kernels built for the CPU
        return CudaOps(np, CpuLauncher())
    if not gpu_available():
        pytest.skip("no GPU: CuPy is not installed or sees no device")
    from model.ops import cupy_ops

    return cupy_ops.create("float32")


@pytest.fixture(scope="module", params=["numpy", "numba-q8_0", "cuda-harness", pytest.param("cuda", marks=pytest.mark.gpu)])
def harness(request, tiny_dir):
    ops = backend(request.param)
    runner = ModelRunner.from_dir(tiny_dir, num_blocks=256, block_size=4, ops=ops)
    return lambda **config: Harness(runner, Tokenizer(tiny_dir), prefill_chunk=config.pop("prefill_chunk", 7),
                                    **config)


@pytest.fixture(scope="module")
def prompt(tiny_dir):
    return Tokenizer(tiny_dir).encode(TEXT)


def one_at_a_time(make, prompt) -> list[float]:
    """Each prompt token's logprob as sampling reads it after the prefix before it: the token is
    forced by a bias, and logprobs are of the distribution before the bias."""
    h = make()
    rids = [h.submit(prompt[:k], max_tokens=1, sampling=SamplingParams(
        temperature=0.0, logprobs=0, logit_bias={prompt[k]: 100.0})) for k in range(1, len(prompt))]
    h.run()
    out = []
    for k, rid in enumerate(rids, start=1):
        (entry,) = [e for f in h.frames[rid] for e in f.logprobs or []]
        assert entry[0] == prompt[k]
        out.append(entry[1])
    return out


def scored(h, rid) -> list:
    return [e for f in h.frames[rid] for e in f.prompt_logprobs or []]


def test_a_scored_prompt_equals_its_tokens_scored_one_at_a_time(harness, prompt):
    assert len(prompt) > 3 * 7  # several prefill chunks
    h = harness()
    seed = h.submit(prompt, max_tokens=1)  # fills the prefix cache with this prompt's blocks
    h.run()
    rid = h.submit(prompt, max_tokens=0, prompt_logprobs=3)
    again = h.submit(prompt, max_tokens=1)
    h.run()
    final = h.final(rid)
    assert final.finish_reason == "length" and h.tokens(rid) == [] and final.usage.completion_tokens == 0
    assert final.usage.cached_tokens == 0 and h.final(again).usage.cached_tokens > 0  # scoring skipped the cache
    assert h.final(seed).usage.cached_tokens == 0
    entries = scored(h, rid)
    assert [e[0] for e in entries] == prompt[1:]
    expected = one_at_a_time(harness, prompt)
    assert max(abs(e[1] - x) for e, x in zip(entries, expected)) < TOLERANCE
    for token, logprob, rank, top in entries:
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert rank == 1 + sum(lp > logprob for _, lp in top) or (rank > 3 and token not in dict(top))
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(logprob)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunking_gives_the_same_scores_in_order(harness, prompt, chunk):
    h = harness(prefill_chunk=chunk)
    rid = h.submit(prompt, max_tokens=0, prompt_logprobs=0)
    h.run()
    entries = scored(h, rid)
    assert [e[0] for e in entries] == prompt[1:] and all(e[3] == [] for e in entries)
    reference = harness(prefill_chunk=len(prompt))
    whole = reference.submit(prompt, max_tokens=0, prompt_logprobs=0)
    reference.run()
    assert max(abs(a[1] - b[1]) for a, b in zip(entries, scored(reference, whole))) < TOLERANCE


def test_a_generation_carries_its_prompt_logprobs_in_its_first_frame(harness, prompt):
    h = harness()
    rid = h.submit(prompt, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    plain = h.submit(prompt, max_tokens=4, ignore_eos=True)
    h.run()
    assert h.tokens(rid) == h.tokens(plain) and len(h.tokens(rid)) == 4
    frames = [f for f in h.frames[rid] if f.prompt_logprobs]
    assert len(frames) == 1 and frames[0] is h.frames[rid][0] and len(frames[0].prompt_logprobs) == len(prompt) - 1
    assert not any(f.prompt_logprobs for f in h.frames[plain])


def test_max_tokens_zero_without_scores_reads_the_prompt_only(harness, prompt):
    h = harness()
    rid = h.submit(prompt, max_tokens=0)
    h.run()
    final = h.final(rid)
    assert final.finish_reason == "length" and h.tokens(rid) == [] and final.usage.prompt_tokens == len(prompt)
    assert final.prompt_logprobs is None
