"""The linear-attention reference (model/ops/delta_rule.py) against independent formulations:
the gated delta rule against its chunked closed form (a triangular solve per chunk, in float64),
the convolution against NumPy's own, and both against themselves fed in pieces."""

import numpy as np
import pytest

from model.ops.delta_rule import causal_conv, gated_delta_rule, gated_rms_norm, l2_normalize


def inputs(rng, tokens, heads=3, k_dim=8, v_dim=6):
    q = l2_normalize(rng.standard_normal((tokens, heads, k_dim)).astype(np.float32)) / np.float32(np.sqrt(k_dim))
    k = l2_normalize(rng.standard_normal((tokens, heads, k_dim)).astype(np.float32))
    v = rng.standard_normal((tokens, heads, v_dim)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (tokens, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (tokens, heads)).astype(np.float32)
    state = rng.standard_normal((heads, k_dim, v_dim)).astype(np.float32)
    return q, k, v, g, beta, state


def chunked(q, k, v, g, beta, state):
    """The rule over a whole chunk at once: with G the running sum of g, each token's write
    u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{j<t} e^{G_t - G_j} (k_t . k_j) u_j) is a lower
    triangular system; outputs and the final state are sums over the writes."""
    q, k, v, g, beta, s0 = (x.astype(np.float64) for x in (q, k, v, g, beta, state))
    tokens, heads = g.shape
    out, final = np.empty(v.shape), np.empty(s0.shape)
    for h in range(heads):
        G = np.cumsum(g[:, h])
        decay = np.tril(np.exp(G[:, None] - G[None, :]))
        system = np.eye(tokens) + np.tril(beta[:, h, None] * decay * (k[:, h] @ k[:, h].T), -1)
        u = np.linalg.solve(system, beta[:, h, None] * (v[:, h] - np.exp(G)[:, None] * (k[:, h] @ s0[h])))
        out[:, h] = np.exp(G)[:, None] * (q[:, h] @ s0[h]) + (decay * (q[:, h] @ k[:, h].T)) @ u
        final[h] = np.exp(G[-1]) * s0[h] + (np.exp(G[-1] - G)[:, None] * k[:, h]).T @ u
    return out, final


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_the_delta_rule_matches_its_chunked_closed_form(tokens):
    args = inputs(np.random.default_rng(tokens), tokens)
    got_out, got_state = gated_delta_rule(*args)
    want_out, want_state = chunked(*args)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_state, want_state, rtol=1e-4, atol=1e-5)


def test_without_decay_a_full_write_stores_each_value_under_its_key():
    """g = 0 and beta = 1 with orthonormal keys: the state then maps each key to its value."""
    rng = np.random.default_rng(0)
    keys = np.linalg.qr(rng.standard_normal((8, 8)))[0][:5].astype(np.float32)[:, None, :]
    values = rng.standard_normal((5, 1, 4)).astype(np.float32)
    zeros, ones = np.zeros((5, 1), np.float32), np.ones((5, 1), np.float32)
    _, state = gated_delta_rule(keys, keys, values, zeros, ones, np.zeros((1, 8, 4), np.float32))
    out, _ = gated_delta_rule(keys, keys, values, zeros, zeros, state)  # beta 0: read without writing
    np.testing.assert_allclose(out, values, atol=1e-5)


def test_a_prompt_fed_in_pieces_keeps_its_bits():
    args = inputs(np.random.default_rng(1), 40)
    whole_out, whole_state = gated_delta_rule(*args)
    q, k, v, g, beta, state = args
    outs = []
    for lo, hi in [(0, 7), (7, 8), (8, 31), (31, 40)]:
        out, state = gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        outs.append(out)
    assert np.array_equal(np.concatenate(outs), whole_out) and np.array_equal(state, whole_state)


def test_the_convolution_is_numpys_causal_one_and_carries_its_history():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 5)).astype(np.float32)
    weight = rng.standard_normal((5, 4)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    out, history = causal_conv(x, np.zeros((3, 5), np.float32), weight, bias)
    for c in range(5):  # np.convolve flips its kernel: the newest tap is weight[:, -1]
        pre = np.convolve(x[:, c].astype(np.float64), weight[c, ::-1].astype(np.float64))[:20] + bias[c]
        np.testing.assert_allclose(out[:, c], pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-6)
    assert np.array_equal(history, x[-3:])
    first, carried = causal_conv(x[:9], np.zeros((3, 5), np.float32), weight, bias)
    rest, after = causal_conv(x[9:], carried, weight, bias)
    assert np.array_equal(np.concatenate([first, rest]), out) and np.array_equal(after, history)


def test_the_gated_norm_scales_by_the_gates_silu():
    x = np.array([[3.0, -4.0]], np.float32)  # rms 3.5355
    out = gated_rms_norm(x, np.array([[0.0, 50.0]], np.float32), np.array([2.0, 1.0], np.float32), 0.0)
    np.testing.assert_allclose(out, [[0.0, -4.0 / np.sqrt(12.5) * 50.0]], rtol=1e-6)  # silu(0) = 0, silu(50) = 50


def ragged_rows(lengths, slots, fresh=None):
    from model.kv_cache import StateRows

    counts = np.array(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return StateRows(starts, counts, np.array(slots, np.int64),
                     np.array(fresh if fresh is not None else [False] * len(lengths)))


@pytest.mark.parametrize("lengths", [[1], [5, 1, 33, 1], [200, 3]])
def test_the_compiled_steps_match_the_reference_row_by_row(lengths):
    """The numba convolution and delta rule against delta_rule's, over ragged rows in
    scattered slots (each row's history and state its own), and on one core (few rows) and on
    every core (many) to the same bits."""
    from model.ops import numba_delta_rule
    from model.ops.delta_rule import convolve_rows, delta_rule_rows

    rng = np.random.default_rng(len(lengths))
    tokens, rows = sum(lengths), ragged_rows(lengths, [3, 0, 5, 1][:len(lengths)])
    x = rng.standard_normal((tokens, 70)).astype(np.float32)  # a block of 64 channels and a ragged one
    weight = rng.standard_normal((70, 4)).astype(np.float32)
    history = rng.standard_normal((6, 3, 70)).astype(np.float32)
    want_history = history.copy()
    want = convolve_rows(x, want_history, weight, rows)
    got = numba_delta_rule.convolve_rows(x, history, weight, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(history, want_history)  # the history is copied, not computed

    q, k, v, g, beta, _ = inputs(rng, tokens, heads=4, k_dim=16, v_dim=8)
    state = rng.standard_normal((6, 4, 16, 8)).astype(np.float32)
    want_state = state.copy()
    want = delta_rule_rows(q, k, v, g, beta, want_state, rows)
    got = numba_delta_rule.delta_rule_rows(q, k, v, g, beta, state, rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(6) if s not in rows.slots]
    assert np.array_equal(state[untouched], want_state[untouched])


def test_the_compiled_rule_fed_in_pieces_keeps_its_bits():
    """A row's state and outputs in numba: the same bits fed whole or a few tokens a step, and
    beside other rows."""
    from model.ops import numba_delta_rule

    rng = np.random.default_rng(9)
    q, k, v, g, beta, s0 = inputs(rng, 40, heads=4, k_dim=16, v_dim=8)
    whole_state = np.zeros((2, 4, 16, 8), np.float32)
    whole_state[1] = s0
    whole = numba_delta_rule.delta_rule_rows(q, k, v, g, beta, whole_state, ragged_rows([40], [1]))
    state = np.zeros((3, 4, 16, 8), np.float32)
    state[2] = s0
    outs = []
    for lo, hi in [(0, 7), (7, 8), (8, 31), (31, 40)]:
        other = rng.standard_normal((5, 4, 16)).astype(np.float32)  # a neighbour row of 5 tokens, in slot 0
        pq, pk = np.concatenate([other, q[lo:hi]]), np.concatenate([other, k[lo:hi]])
        pv = np.concatenate([rng.standard_normal((5, 4, 8)).astype(np.float32), v[lo:hi]])
        pg, pb = np.concatenate([g[:5], g[lo:hi]]), np.concatenate([beta[:5], beta[lo:hi]])
        out = numba_delta_rule.delta_rule_rows(pq, pk, pv, pg, pb, state, ragged_rows([5, hi - lo], [0, 2]))
        outs.append(out[5:])
    assert np.array_equal(np.concatenate(outs), whole) and np.array_equal(state[2], whole_state[1])
