"""LoRA's per-token products (ops.lora, model/lora.py) in cuda/lora.cu through the CPU harness (and
CuPy where a GPU is present), against NumpyOps.lora on float32 copies of the same storage-rounded
inputs; and the numba op against NumPy. Ragged token counts, several adapters' tokens interleaved
with base-model tokens (slot -1: their rows stay the same bits), ranks 1 to 64, widths on and off
multiples of 32, a module's columns in the middle of a wider fused output (first > 0). The
kernels sum in fp32 and round y once to the storage type, so a 16-bit result is within about an
ulp of the reference's; a token's row is the same bits alone and in any batch."""

import numpy as np
import pytest

from cuda_harness import as_float, storage
from model.ops import numba_lora
from model.ops.cuda_ops import CudaOps
from model.ops.kernels import name_expression
from model.ops.numba_kernels import PARALLEL_WORK
from model.ops.numpy_ops import NumpyOps
from test_kernels import launcher  # noqa: F401 (the fixture: the CPU harness, and CuPy on a GPU)

NUMPY = NumpyOps()
DTYPES = ["float32", "float16", "bfloat16"]
ULP = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -7}
ADAPTERS = 4  # slots in the stacks

def stacks(rng, rank, width, out):
    """Every slot's A (slots, rank, in) and B (slots, out, rank), fp32, scaled so that a token's
    share is O(1) like y's own values."""
    a = (rng.standard_normal((ADAPTERS, rank, width)) / np.sqrt(width)).astype(np.float32)
    b = (rng.standard_normal((ADAPTERS, out, rank)) / np.sqrt(rank)).astype(np.float32)
    return a, b


def token_slots(rng, tokens):
    """Adapters' tokens interleaved with the base model's (-1), the first token adapted and the
    second not wherever there are two; scales for every token, -1's included (unused)."""
    slots = rng.integers(-1, ADAPTERS, size=tokens).astype(np.int32)
    slots[0] = rng.integers(0, ADAPTERS)
    if tokens > 1:
        slots[1] = -1
    return slots, rng.uniform(0.25, 2.0, size=tokens).astype(np.float32)


def case(seed, tokens, rank, width, out, first, dtype, tail=24):
    rng = np.random.default_rng(seed)
    a, b = stacks(rng, rank, width, out)
    slots, scales = token_slots(rng, tokens)
    x = storage(rng.standard_normal((tokens, width)), dtype)
    y = storage(rng.standard_normal((tokens, first + out + tail)), dtype)
    return y, x, a, b, slots, scales


def reference(y, x, a, b, slots, scales, first, dtype):
    return NUMPY.lora(as_float(y, dtype).copy(), as_float(x, dtype), a, b, slots, scales, first)


def same_bits(p, q):
    """Equal as bit patterns (a NaN poison included)."""
    bits = np.dtype(f"u{p.itemsize}")
    return p.dtype == q.dtype and np.array_equal(p.view(bits), q.view(bits))


def check(got, y, want, slots, first, out, dtype):
    """The module's columns of adapted rows within an ulp (plus fp32 noise) of the reference; every
    other element the same bits as before."""
    adapted = slots >= 0
    span = slice(first, first + out)
    assert same_bits(got[~adapted], y[~adapted]), "a base-model row changed"
    assert same_bits(got[:, :first], y[:, :first]) and same_bits(got[:, first + out:], y[:, first + out:])
    got_f, want_f = as_float(got[adapted, span], dtype), want[adapted, span]
    assert not np.isnan(got_f).any()
    tol = ULP[dtype] * (np.abs(want_f) + 1.0) * 2
    bad = np.abs(got_f - want_f) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; worst {np.abs(got_f - want_f).max()}"


TOKENS, RANKS = [1, 3, 17, 64], [1, 8, 16, 64]
SHAPES = [(72, 200, 40), (64, 256, 0), (200, 72, 136), (256, 64, 64)]  # width, out, first
# every dtype with every shape, each time another token count and rank: 12 of the 64 pairs, every
# token count and rank with every dtype
CASES = [(dtype, TOKENS[k], RANKS[(k + d) % 4], *SHAPES[k]) for d, dtype in enumerate(DTYPES) for k in range(4)]


@pytest.mark.parametrize("dtype,tokens,rank,width,out,first", CASES)
def test_cuda_ops_lora_matches_numpy(launcher, dtype, tokens, rank, width, out, first):
    ops = CudaOps(np, launcher, dtype)
    y, x, a, b, slots, scales = case(tokens * 1000 + rank * 10 + width, tokens, rank, width, out, first, dtype)
    want = reference(y, x, a, b, slots, scales, first, dtype)
    got = ops.lora(y.copy(), x, a, b, slots, scales, first)
    check(got, y, want, slots, first, out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 128])  # one warp, or a warp per rank of four at a time
@pytest.mark.parametrize("rank,width,out", [(8, 72, 200), (16, 256, 64), (3, 33, 5)])
def test_kernels_skip_base_rows_of_poisoned_scratch(launcher, dtype, block, rank, width, out):
    """The shrink writes every adapted token's ranks and nothing else; the expand never reads a
    base-model token's scratch (NaN here) and never touches its row, NaN-poisoned too."""
    tokens, first = 9, 7
    y, x, a, b, slots, scales = case(rank + width, tokens, rank, width, out, first, dtype)
    y[slots < 0] = storage(np.full((int((slots < 0).sum()), y.shape[1]), np.nan), dtype)
    shrunk = np.full((tokens, rank), np.nan, dtype=np.float32)

    def kernel(name):
        return launcher.function("lora.cu", name_expression(name, dtype))

    kernel("lora_shrink")((tokens,), (block,), (shrunk, x, a, slots, scales, np.int32(width), np.int32(rank)))
    adapted = slots >= 0
    assert np.isnan(shrunk[~adapted]).all()
    x32 = as_float(x, dtype)
    want_shrunk = np.stack([(a[s] @ x32[t]) * scales[t] for t, s in enumerate(slots) if s >= 0])
    np.testing.assert_allclose(shrunk[adapted], want_shrunk, rtol=1e-5, atol=1e-5)
    got = y.copy()
    kernel("lora_expand")((-(-out // block), tokens), (block,), (
        got, shrunk, b, slots, np.int32(out), np.int32(rank), np.int32(y.shape[1]), np.int32(first)))
    check(got, y, reference(y, x, a, b, slots, scales, first, dtype), slots, first, out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_row_is_the_same_bits_alone_and_in_any_batch(launcher, dtype):
    """Batch invariance: each adapted token of a 33-token batch of four adapters and base rows,
    again alone, and again at another place among other neighbours."""
    ops = CudaOps(np, launcher, dtype)
    rank, width, out, first = 16, 200, 72, 40
    y, x, a, b, slots, scales = case(7, 33, rank, width, out, first, dtype)
    batch = ops.lora(y.copy(), x, a, b, slots, scales, first)
    order = np.random.default_rng(8).permutation(33)
    shuffled = ops.lora(y[order].copy(), x[order], a, b, slots[order], scales[order], first)
    assert np.array_equal(shuffled, batch[order])
    for t in np.flatnonzero(slots >= 0)[:6]:
        alone = ops.lora(y[t:t + 1].copy(), x[t:t + 1], a, b, slots[t:t + 1], scales[t:t + 1], first)
        assert np.array_equal(alone[0], batch[t])
    for t in np.flatnonzero(slots >= 0)[:3]:  # the same token under each adapter, alone and batched
        for s in range(ADAPTERS):
            moved = slots.copy()
            moved[t] = s
            alone = ops.lora(y[t:t + 1].copy(), x[t:t + 1], a, b, moved[t:t + 1], scales[t:t + 1], first)
            assert np.array_equal(alone[0], ops.lora(y.copy(), x, a, b, moved, scales, first)[t])


def test_no_tokens(launcher):
    ops = CudaOps(np, launcher, "bfloat16")
    a, b = stacks(np.random.default_rng(1), 8, 64, 64)
    y, x = storage(np.zeros((0, 88)), "bfloat16"), storage(np.zeros((0, 64)), "bfloat16")
    assert ops.lora(y, x, a, b, np.zeros(0, np.int32), np.zeros(0, np.float32), 0).shape == (0, 88)


@pytest.mark.parametrize("rank,width,out,first", [(16, 200, 72, 40), (8, 64, 256, 0), (4, 72, 200, 8)])
def test_numba_lora_matches_numpy_and_is_the_same_bits_alone(rank, width, out, first):
    """The CPU's op: NumPy's result to float32 rounding; a token alone (the serial twin) and in a
    64-token batch (past PARALLEL_WORK: the prange twin) gives the same bits."""
    y, x, a, b, slots, scales = case(rank + out, 64, rank, width, out, first, "float32")
    assert int((slots >= 0).sum()) * rank * (width + out) >= PARALLEL_WORK
    want = reference(y, x, a, b, slots, scales, first, "float32")
    got = numba_lora.lora(y.copy(), x, a, b, slots, scales, first)
    check(got, y, want, slots, first, out, "float32")
    for t in np.flatnonzero(slots >= 0)[:5]:
        alone = numba_lora.lora(y[t:t + 1].copy(), x[t:t + 1], a, b, slots[t:t + 1], scales[t:t + 1], first)
        assert np.array_equal(alone[0], got[t])
