"""cuda/moe.cu's router (issue 51, item 2): the logits as one GEMM over the step's tokens
(moe_router), then a warp per token for the top k, whose last block sorts the routed rows
(moe_topk). Through the CPU harness, against the NumPy reference (model/ops/moe.py's route) and
against the kernels they replaced (tests/data/cuda_before/moe_route.cu, the old moe_route): the
same experts and the same weights, to the bit, on random inputs and on ties."""

import numpy as np
import pytest

import model.ops.kernels as kernels
from cuda_harness import CpuLauncher, storage
from model.ops.cuda_ops import CudaOps
from model.ops.kernels import name_expression
from model.ops.moe import route

BEFORE = "../tests/data/cuda_before/moe_route.cu"  # relative to cuda/, where the harness looks
TILE_ROWS = 16  # cuda/moe.cu's MOE_TILE_ROWS


@pytest.fixture(scope="module")
def launcher():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(kernels.KERNELS, BEFORE, ("moe_route",))
        launcher = CpuLauncher()
        launcher.function(BEFORE, "moe_route<float>")  # built while the patch names its kernels
        yield launcher


def new_route(launcher, x, router, bias, top_k, normalize, scale=None, dtype="float32", done=None):
    """moe_router then moe_topk as CudaOps.moe launches them: (logits, ids, weights, starts,
    tile_starts, tokens_of, position), outputs poisoned first."""
    tokens, hidden = x.shape
    experts = router.shape[0]
    logits = np.full((tokens, experts), np.nan, dtype=np.float32)
    launcher.function("moe.cu", name_expression("moe_router", dtype))((-(-experts // 4), -(-tokens // 8)), (128,), (
        logits, x, router, bias if bias is not None else np.uint64(0), np.int32(tokens), np.int32(hidden),
        np.int32(experts)))
    ids, weights = np.full((tokens, top_k), -9, dtype=np.int32), np.full((tokens, top_k), np.nan, dtype=np.float32)
    starts, tile_starts = np.full(experts + 1, -9, dtype=np.int32), np.full(experts + 1, -9, dtype=np.int32)
    tokens_of, position = np.full(tokens * top_k, -9, dtype=np.int32), np.full(tokens * top_k, -9, dtype=np.int32)
    done = np.zeros(1, dtype=np.int32) if done is None else done
    launcher.function("moe.cu", "moe_topk")((-(-tokens // 4),), (128,), (
        ids, weights, starts, tile_starts, tokens_of, position, done, logits,
        scale if scale is not None else np.uint64(0), np.int32(tokens), np.int32(experts), np.int32(top_k),
        np.int32(normalize)))
    return logits, ids, weights, starts, tile_starts, tokens_of, position


def old_route(launcher, x, router, bias, top_k, normalize, dtype="float32"):
    tokens, hidden = x.shape
    ids, weights = np.full((tokens, top_k), -9, dtype=np.int32), np.full((tokens, top_k), np.nan, dtype=np.float32)
    launcher.function(BEFORE, f"moe_route<{kernels.STORAGE_TYPES[dtype]}>")((tokens,), (128,), (
        ids, weights, x, router, bias if bias is not None else np.uint64(0), np.int32(hidden),
        np.int32(router.shape[0]), np.int32(top_k), np.int32(normalize)))
    return ids, weights


def inputs(seed, tokens, hidden, experts, ties: bool, dtype: str):
    """Random tokens and router rows; with ties, experts in pairs of equal router rows (equal
    logits), a token of zeros (every logit equal) and a token equal to another."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    router = (rng.standard_normal((experts, hidden)) * 0.2).astype(np.float32)
    if ties:
        router[1::2] = router[0::2][:experts // 2]
        router[experts - 1] = router[3]
        x[0] = 0.0
        x[-1] = x[min(1, tokens - 1)]
    return storage(x, dtype), router


CASES = [(1, 64, 8, 2, True), (5, 96, 60, 4, False), (37, 128, 128, 8, True), (9, 64, 256, 8, False),
         (13, 160, 32, 1, True), (70, 64, 128, 8, False)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tokens, hidden, experts, top_k, ties", CASES)
@pytest.mark.parametrize("normalize", [0, 1])
def test_the_router_routes_as_the_kernel_it_replaced_and_as_the_reference(launcher, dtype, tokens, hidden, experts,
                                                                          top_k, ties, normalize):
    x, router = inputs(tokens * experts + top_k, tokens, hidden, experts, ties, dtype)
    bias = (np.random.default_rng(1).standard_normal(experts) * 0.1).astype(np.float32) if experts == 60 else None
    if ties and bias is None and experts % 2 == 0:
        bias = np.zeros(experts, dtype=np.float32)  # equal logits stay equal with a bias of equal pairs
        bias[0::2] = bias[1::2] = np.linspace(0, 0.1, experts // 2, dtype=np.float32)
        bias[experts - 1] = bias[3]
    logits, ids, weights, starts, tile_starts, tokens_of, position = new_route(
        launcher, x, router, bias, top_k, normalize, dtype=dtype)
    was_ids, was_weights = old_route(launcher, x, router, bias, top_k, normalize, dtype)
    np.testing.assert_array_equal(ids, was_ids)
    np.testing.assert_array_equal(weights.view(np.uint32), was_weights.view(np.uint32))

    plan = route(logits, top_k, bool(normalize))
    want_ids = np.empty(tokens * top_k, dtype=np.int64)  # each routed row's expert, from the plan's sort
    for e in range(experts):
        want_ids[plan.order[plan.starts[e]:plan.starts[e + 1]]] = e
    np.testing.assert_array_equal(ids, want_ids.reshape(tokens, top_k))
    np.testing.assert_allclose(weights, plan.weights, rtol=2e-6, atol=1e-7)
    counts = np.diff(plan.starts)
    np.testing.assert_array_equal(starts, plan.starts)
    np.testing.assert_array_equal(tile_starts, np.concatenate([[0], np.cumsum(-(-counts // TILE_ROWS))]))
    np.testing.assert_array_equal(tokens_of, plan.tokens)
    np.testing.assert_array_equal(position[plan.order], np.arange(tokens * top_k))
    if ties:
        assert ids[0].tolist() == list(range(top_k)) or bias is not None  # all equal: the lowest ids


def test_gemma4s_expert_scale_multiplies_each_chosen_weight(launcher):
    x, router = inputs(3, 11, 64, 16, True, "bfloat16")
    scale = np.random.default_rng(4).uniform(0.5, 2.0, 16).astype(np.float32)
    _, ids, weights, *_ = new_route(launcher, x, router, None, 4, 1, scale, dtype="bfloat16")
    was_ids, was_weights = old_route(launcher, x, router, None, 4, 1, "bfloat16")
    np.testing.assert_array_equal(ids, was_ids)
    np.testing.assert_array_equal(weights, was_weights * scale[was_ids])  # as CudaOps.moe multiplied before


def test_the_block_counter_is_left_zero_for_a_graphs_replay(launcher):
    """moe_topk's last block sorts the rows and zeroes the count of finished blocks, so a
    replayed graph (the same buffer, not zeroed again) routes the same."""
    x, router = inputs(5, 23, 64, 32, False, "float32")
    done = np.zeros(1, dtype=np.int32)
    first = new_route(launcher, x, router, None, 4, 1, done=done)
    assert done[0] == 0
    again = new_route(launcher, x, router, None, 4, 1, done=done)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_cuda_ops_moe_matches_numpy_ops_moe_with_every_option():
    """CudaOps.moe (float32 through the harness) against NumpyOps.moe: a router bias, expert
    biases and the clamped SwiGLU (GPT-OSS), a shared expert with its gate (Qwen3.5-MoE), and
    router_x and expert_scale (Gemma 4)."""
    from model.ops.numpy_ops import NumpyOps
    from model.weights import Experts

    rng = np.random.default_rng(7)
    tokens, hidden, inter, count = 19, 64, 32, 8
    f = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    x = f(tokens, hidden, s=1.0)
    variants = [
        dict(router_bias=f(count), gate_up_bias=f(count * 2 * inter), down_bias=f(count * hidden),
             swiglu_clamp=(1.702, 7.0)),
        dict(shared_gate_up=f(2 * inter, hidden), shared_down=f(hidden, inter), shared_gate=f(1, hidden)),
        dict(expert_scale=rng.uniform(0.5, 2.0, count).astype(np.float32)),
    ]
    for i, extra in enumerate(variants):
        experts = Experts(router=f(count, hidden), gate_up=f(count * 2 * inter, hidden), down=f(count * hidden, inter),
                          top_k=3, normalize=i != 0, **extra)
        router_x = f(tokens, hidden, s=1.0) if "expert_scale" in extra else None
        want = NumpyOps().moe(x, experts, router_x=router_x)
        got = CudaOps(np, CpuLauncher()).moe(x, experts, router_x=router_x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
