"""The ops contract: every op and attribute the forward pass, the runner and the KV cache use,
which each backend (NumPy, the numba CPU kernels, CUDA) implements as one class.

model/llama.py is written once against `Ops`; a new op is added here first, then to each
backend. Sampling takes a `SampleBatch` (one entry per row of the logits) and gives a
`SampleResult`; scoring given tokens (a prompt's) gives `Scored`. What only a device has is an attribute every backend carries: `asynchronous`
says whether a step returns before its work has run, and `launcher` is the device's launcher
(CUDA graphs, pinned host memory, side-stream copies, memory sizing), None on the CPU.
"""

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from model.sampling import XTC_STREAM, SamplingParams, seeded_uniform


class Download:
    """An array's copy to the host, started when made; result() waits for it (on the device:
    for an event recorded after the copy, not for everything queued since)."""

    def __init__(self, host: np.ndarray, event=None):
        self.host, self.event = host, event

    def result(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class SampleBatch:
    """What one step samples, an entry per row of the logits (except rng)."""

    params: Sequence[SamplingParams]
    prompts: Sequence[Sequence[int]]  # prompt ids, for the repetition penalty
    outputs: Sequence[Sequence[int]]  # output ids so far: for penalties, and the seeded draw's token index
    rng: np.random.Generator  # the draws of rows without a seed
    keys: Sequence | None = None  # each row's request, so a backend may keep state per request; None: keep none
    masks: Sequence[np.ndarray | None] | None = None  # a grammar's allowed tokens (allowed_tokens' words), or None

    def __len__(self) -> int:
        return len(self.params)

    def mask(self, row: int) -> np.ndarray | None:
        return self.masks[row] if self.masks else None

    def uniform(self, row: int) -> float:
        """The row's draw in [0, 1): 0 for a greedy row (rng untouched), keyed by (seed, token
        index) for a seeded one, else the next of rng."""
        p = self.params[row]
        if p.greedy:
            return 0.0
        return seeded_uniform(p.seed, len(self.outputs[row])) if p.seed is not None else self.rng.random()

    def coin(self, row: int) -> float:
        """XTC's coin for the row in [0, 1): keyed as uniform's but on a stream of its own, so the
        draw's numbers stay the same; 1.0 (never) for a row without XTC (rng untouched)."""
        p = self.params[row]
        if p.greedy or not p.excludes_top_choices:
            return 1.0
        return seeded_uniform(p.seed, len(self.outputs[row]), XTC_STREAM) if p.seed is not None else self.rng.random()

    def take(self, rows: Sequence[int]) -> "SampleBatch":
        """The batch of these rows only (the same rng)."""
        return SampleBatch([self.params[r] for r in rows], [self.prompts[r] for r in rows],
                           [self.outputs[r] for r in rows], self.rng,
                           [self.keys[r] for r in rows] if self.keys is not None else None,
                           [self.masks[r] for r in rows] if self.masks else None)


@dataclass
class SampleResult:
    token_ids: Any  # (rows,) integer ids on the ops' device: to_host or download them
    logprobs: list[float | None]  # of the raw distribution (before mask, penalties, temperature); None: not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), most likely first
    mirostat_mu: list[float | None] | None = None  # a mirostat row's mu after its draw, for the engine to keep
    # CUDA, where a row asks for logprobs: the PackedLogprobs (model/ops/packed_logprobs.py) whose one device
    # array holds the ids, then the logprobs: download packed.device instead of token_ids, and hand the copy to
    # packed.arrived(), which gives the ids; logprobs and top_logprobs are read from it
    packed: Any = None


@dataclass
class Scored:
    """Given tokens under their rows' raw distributions (a prompt's tokens, for prompt_logprobs)."""

    logprobs: list[float]
    ranks: list[int]  # 1 + how many tokens the row finds more likely
    top_logprobs: list[list[tuple[int, float]]]  # (token id, logprob), most likely first
    packed: Any = None  # CUDA: the PackedLogprobs they are read from, as SampleResult's


class Launcher(Protocol):
    """What CudaOps runs on: CuPy's RawModule and cuBLAS on a GPU (model/ops/cupy_ops.py), or
    the CPU harness (tests/cuda_harness.py), which builds the same .cu files with g++."""

    multiprocessors: int  # the device's streaming multiprocessors (SMs), for sizing grids
    def function(self, file: str, expression: str) -> Callable: ...  # called (grid, block, args, shared_mem=0)
    def linear(self, x, w, bias, out) -> None: ...  # out = x @ w.T (+ bias), accumulated in fp32
    def memory_info(self) -> tuple[int, int]: ...  # (free, total) bytes of device memory
    def synchronize(self) -> None: ...
    def release_cached(self) -> None: ...  # pooled memory no array uses goes back to the device
    def pinned(self, size: int, dtype) -> np.ndarray: ...  # page-locked host memory
    def upload(self, device, host) -> Any: ...  # host (pinned) into device, queued; the event after it
    def download(self, device) -> tuple[np.ndarray, Any]: ...  # (host copy, the event after it)
    def copy_to_host(self, device, hosts) -> Any: ...  # device[i] into hosts[i] on a side stream; its event
    def copy_to_device(self, hosts, after) -> Any: ...  # the hosts stacked on the device, after the event
    def capture(self, fn) -> Any: ...  # fn's kernels as a graph: .replay() and .output


SCALE_BYTES = 4  # a q8_0 K/V token's float32 scale, inline after its head vector's int8 values


@runtime_checkable
class Ops(Protocol):
    name: str
    xp: ModuleType  # the array module of this backend's arrays (NumPy, or CuPy on a GPU)
    storage_dtype: np.dtype  # of weights, activations and K/V
    kv_q8_0: bool  # K/V held as q8_0 instead: int8, and each token's scale in SCALE_BYTES beside (model/kv_cache.py)
    asynchronous: bool  # kernels are queued: a step returns before the device has run it
    attention_cost: float  # time of an attention multiply-add over a projection's (the planner's prefill chunks)
    launcher: Launcher | None  # the device's; None on the CPU

    def asarray(self, x, dtype=np.float32): ...
    def to_host(self, x) -> np.ndarray: ...
    def download(self, x) -> Download: ...
    def zeros(self, shape, dtype=np.float32): ...
    def weight(self, x): ...  # a host weight (float32, or a GGUF's blocks: model/quant/quantized.py) as kept here
    def loaded(self) -> None: ...  # a model's weights have all been through weight()
    def embedding(self, table, token_ids, scale: float = 1.0): ...  # rows times scale
    def linear(self, x, w, bias=None): ...  # x @ w.T (+ bias)
    def lora(self, y, x, a, b, slots, scales, first: int): ...  # LoRA's per-token products added into
    # y's columns from first (model/lora.py): a (slots, rank, in), b (slots, out, rank); slots[t] -1: none
    def logits(self, h, w, softcap: float = 0.0, out=None): ...  # the LM head, in fp32; cap * tanh(l / cap)
    # where set; into out (rows, vocab) where given (the decode graphs' one buffer, model/cuda_graphs.py)
    def rms_norm(self, x, weight, eps: float): ...
    def add_rms_norm(self, x, delta, weight, eps: float) -> tuple: ...  # x += delta in place; (x, rms_norm(x))
    def rope(self, x, cos, sin): ...
    def silu_and_mul(self, gate_up): ...
    def gelu_and_mul(self, gate_up): ...  # GELU's tanh form
    def sigmoid_mul(self, x, gate): ...  # x * sigmoid(gate)
    def scale_tokens(self, x, factors): ...  # each token's row times factors[token] (fp32)
    # a delta-net layer from its input projection to its gated output (model/ops/delta_rule.py); the
    # layer's state slots (kv_cache.KVCache.conv, .recurrent) updated for the rows (kv_cache.StateRows)
    def gated_delta_net(self, proj, weights, shape, history, state, rows, eps: float): ...
    def moe(self, x, experts, gelu: bool = False, router_x=None): ...  # model.weights.Experts in place of the
    # MLP; router_x: what the router reads where it is not x (Gemma 4's)
    def write_kv(self, cache_k, cache_v, slots, k, v) -> None: ...
    def rope_and_cache(self, qkv, cos, sin, cache_k, cache_v, slots, heads: int, q_norm=None, k_norm=None,
                       v_norm=None, eps: float = 0.0) -> Any: ...  # rotated q; q and k RMS-normalised first
    # where q_norm and k_norm are given, over each head (weights of head_dim) or the whole projection
    # (OLMoE's), v over each head where v_norm is; qkv's rows q, (a gate,) k, v
    def attention_meta(self, query_lens, context_lens, block_tables, block_size: int): ...  # once per step
    def paged_attention(self, q, cache_k, cache_v, meta, scale: float, window: int = 0,
                        softcap: float = 0.0, sinks=None): ...  # window: the last positions seen (0: all);
    # sinks: (heads,) float32 logits beside each head's scores (GPT-OSS), in the softmax's sum only
    def sample(self, logits, batch: SampleBatch) -> SampleResult: ...
    def score(self, logits, token_ids, top: int) -> Scored: ...  # token_ids[r] under row r, and its top n
    def release(self, key) -> None: ...  # the request named key has ended
