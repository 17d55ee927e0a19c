"""A mixture of experts on the CPU backends: each token routed to its top k experts, the routed
rows sorted by expert so that an expert's rows are one GEMM (a grouped call for all of them:
NumpyOps.grouped_linear, the packed kernel in model/quant/gemv.py), and each token's k outputs
summed in its own order of choice. Every step here works row by row, so a token's result is the
same bits whatever else is in the batch (the router's GEMM too: router_logits, not OpenBLAS).
"""

from dataclasses import dataclass

import numpy as np
from numba import njit, prange


@dataclass
class ExpertPlan:
    """Where a step's routed rows go: rows sorted by expert, tokens in order within each."""

    tokens: np.ndarray  # (tokens x k,) the token of each routed row
    starts: np.ndarray  # (experts + 1,) int64: expert e's rows are starts[e]:starts[e + 1]
    active: np.ndarray  # (experts with rows,) int64, ascending
    order: np.ndarray  # (tokens x k,) each routed row's place in (token, choice) order
    weights: np.ndarray  # (tokens, k) float32: each choice's weight

    @property
    def experts(self) -> int:
        return self.starts.shape[0] - 1


def route(logits: np.ndarray, top_k: int, normalize: bool, scale: np.ndarray | None = None) -> ExpertPlan:
    """The softmax of the router's logits (tokens, experts), its top k (ties to the lower id),
    rescaled to sum to 1 where normalize says (Mixtral, Qwen3-MoE's norm_topk_prob), then times
    each chosen expert's own scale where there are scales (Gemma 4), as transformers routes."""
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    if normalize:
        weights /= weights.sum(axis=1, keepdims=True)
    if scale is not None:
        weights *= scale[ids]
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=logits.shape[1])
    starts = np.concatenate([[0], np.cumsum(counts)])
    return ExpertPlan(tokens=order // top_k, starts=starts, active=np.flatnonzero(counts), order=order,
                      weights=weights.astype(np.float32))


def combine(routed: np.ndarray, plan: ExpertPlan) -> np.ndarray:
    """Each token's sum of its k experts' outputs (routed rows in plan order) times their
    weights, added in the order the token chose them."""
    tokens, k = plan.weights.shape
    by_choice = np.empty_like(routed)
    by_choice[plan.order] = routed
    by_choice = by_choice.reshape(tokens, k, -1)
    out = by_choice[:, 0] * plan.weights[:, :1]
    for j in range(1, k):
        out += by_choice[:, j] * plan.weights[:, j:j + 1]
    return out


def add_bias(routed: np.ndarray, bias: np.ndarray | None, plan: ExpertPlan) -> np.ndarray:
    """Routed rows (in plan order) plus their expert's bias (experts x width, flat), where the
    experts have biases (GPT-OSS)."""
    if bias is not None:
        routed += bias.reshape(plan.experts, -1)[np.repeat(np.arange(plan.experts), np.diff(plan.starts))]
    return routed


def clamped_swiglu(gate_up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's experts' activation: (up + 1) * g * sigmoid(alpha * g), with the gate g at most
    limit and up within +-limit."""
    half = gate_up.shape[-1] // 2
    gate = np.minimum(gate_up[:, :half], np.float32(limit))
    up = np.clip(gate_up[:, half:], np.float32(-limit), np.float32(limit))
    return (up + np.float32(1.0)) * gate / (np.float32(1.0) + np.exp(np.float32(-alpha) * gate))


@njit("float32[:, ::1](float32[:, ::1], float32[:, ::1])", parallel=True, cache=True, nogil=True,
      fastmath={"nnan", "ninf", "nsz", "reassoc"})
def router_logits(x: np.ndarray, router: np.ndarray) -> np.ndarray:
    """x @ router.T, each row's dot products in one fixed order (a float32 GEMM's blocking
    would depend on the batch, and a routing weight with it)."""
    tokens, experts = x.shape[0], router.shape[0]
    out = np.empty((tokens, experts), dtype=np.float32)
    for t in prange(tokens):
        for e in range(experts):
            total = np.float32(0.0)
            for i in range(x.shape[1]):
                total += x[t, i] * router[e, i]
            out[t, e] = total
    return out
