"""The CUDA backend: CudaOps, the Ops protocol with every op but the GEMMs done by Spool's
kernels (cuda/), on whatever array module and launcher it is given.

On a GPU the arrays are CuPy's and the launcher compiles the .cu files with CuPy's RawModule
(model/ops/cupy_ops.py); in CI the arrays are NumPy's and the launcher is the CPU harness
(tests/cuda_harness.py), which runs the same .cu files. So the whole forward pass of
model/llama.py is tested through the kernels without a GPU. The launcher's methods are the
Launcher protocol (model/ops/protocol.py); model/cuda_graphs.py, model/swap.py and
model/memory.py use it through CudaOps.launcher.

Weights, activations and K/V are in the storage type (float32, float16, or bfloat16 held as
uint16 bits, model/ops/dtypes.py); model/llama.py never does arithmetic on them itself, only
through these ops. Logits are fp32, and sampling runs on the device too
(model/ops/cuda_sampler.py).
"""

import logging
from dataclasses import dataclass

import numpy as np

from model.errors import ModelError, one_line
from model.ops import cuda_quant
from model.ops.cuda_sampler import DeviceSampler
from model.ops.dtypes import ARRAY_DTYPES, to_storage
from model.ops.decode_attention import launch_decode_attention
from model.ops.kernels import TENSOR_CORE_TYPES, name_expression
from model.ops.protocol import SCALE_BYTES, Download, Launcher, SampleBatch, SampleResult, Scored
from model.quant.quantized import float32

THREADS = 128
PREFILL_ROWS = 16  # (token, head) rows per prefill attention block
PREFILL_TC_ROWS = 64  # the same on tensor cores: 16 a warp
PREFILL_KEYS = 32  # keys a prefill block stages at a time, either kernel
NULL = np.uint64(0)  # a null pointer argument (an optional array left out)
MOE_TILE_ROWS, MOE_TILE_COLS = 16, 64  # a grouped GEMM block's rows (of one expert) and columns: cuda/moe.cu

log = logging.getLogger("spool.model")


def prefill_variant(name: str, head_dim: int) -> tuple | None:
    """A prefill attention kernel's instance for head_dim: prefill_attention's DIMS, the output
    elements a lane accumulates (4 up to 128, 8 up to 256, 16 up to 512); the tensor-core kernel
    has none."""
    return None if name == "prefill_attention_tc" else (4 if head_dim <= 128 else 8 if head_dim <= 256 else 16,)


def prefill_shared_bytes(name: str, head_dim: int, itemsize: int) -> int:
    """The dynamic shared memory of a prefill attention block: its staged queries and key (and,
    on CUDA cores, value) tiles, full head_dim rows (cuda/prefill_attention*.cu)."""
    if name == "prefill_attention_tc":
        return (PREFILL_TC_ROWS + PREFILL_KEYS) * (head_dim + 8) * itemsize
    return 4 * (PREFILL_ROWS * head_dim + PREFILL_KEYS * (2 * head_dim + 1))


@dataclass
class AttentionMeta:
    """A step's attention plan on the device, built once and reused by every layer."""

    decode: bool  # every row has one query token: the split-context decode kernel
    query_lens: list
    query_starts: object  # (seqs + 1) int32
    context_lens: object  # (seqs) int32
    block_tables: object  # (seqs, max_blocks) int32
    max_context: int


class CudaOps:
    name = "cuda"
    asynchronous = True  # kernels are queued: a step returns before the device has run it
    attention_cost = 1.0  # not measured on a device yet
    kv_q8_0 = False  # K/V in the storage dtype, or fp8 (kv_fp8); q8_0 is the CPU's

    def __init__(self, xp, launcher: Launcher, dtype: str = "float32", kv: str = "f16"):
        """kv: f16 (K/V in the storage dtype) or fp8 (e4m3 and a float32 scale per token and head:
        model/kv_cache.py)."""
        if kv not in ("f16", "fp8"):
            raise ValueError(f"the CUDA kernels keep K/V as f16 (the --dtype's) or fp8, not {kv}")
        self.xp, self.launcher, self.dtype = xp, launcher, dtype
        self.kv_fp8, self.cache = kv == "fp8", None if kv == "f16" else kv  # cache: kernels' CACHE_TYPES key
        self.storage_dtype = ARRAY_DTYPES[dtype]
        self.sampler = DeviceSampler(self)
        self.tensor_cores = True  # until the tensor-core kernel fails to compile (prefill_kernel)
        self.unpacked: set[str] = set()  # GGUF types dequantized while loading (cuda_quant.loaded says which)

    def kernel(self, file: str, name: str, variant: int | None = None):
        return self.launcher.function(file, name_expression(name, self.dtype, variant, self.cache))

    def asarray(self, x, dtype=np.float32):
        return self.xp.asarray(x, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x) if self.xp is np else self.xp.asnumpy(x)

    def download(self, x) -> Download:
        """x's copy to pinned host memory, queued now; its result() waits for that copy only,
        so a step launched after it keeps the device busy meanwhile."""
        return Download(*self.launcher.download(x))

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype=dtype)

    def weight(self, x):
        """A host weight on the device in the storage type (rounded there, on a GPU); a GGUF's blocks
        kept packed where cuda_quant decodes their type, else dequantized to float32 on the host first."""
        return cuda_quant.packed(self, x) or to_storage(self.xp.asarray(float32(x), dtype=np.float32), self.dtype,
                                                        self.xp)

    def loaded(self) -> None:
        cuda_quant.loaded(self)

    def linear(self, x, w, bias=None):
        """x @ w.T (+ bias) in the storage type, accumulated in fp32: cuBLAS on a GPU."""
        out = self.xp.empty((x.shape[0], w.shape[0]), dtype=self.storage_dtype)
        cuda_quant.linear(self, self.contiguous(x), w, bias, out)
        return out

    def lora(self, y, x, a, b, slots, scales, first: int):
        """NumpyOps.lora in cuda/lora.cu: each token's a @ x to fp32 scratch, then b @ that into y."""
        (tokens, width), (out, rank) = x.shape, b.shape[1:]
        shrunk = self.xp.empty((tokens, rank), dtype=np.float32)
        if tokens:
            self.kernel("lora.cu", "lora_shrink")((tokens,), (THREADS,), (
                shrunk, self.contiguous(x), a, slots, scales, np.int32(width), np.int32(rank)))
            self.kernel("lora.cu", "lora_expand")((-(-out // THREADS), tokens), (THREADS,), (
                y, shrunk, b, slots, np.int32(out), np.int32(rank), np.int32(y.shape[1]), np.int32(first)))
        return y

    def logits(self, h, w, softcap: float = 0.0, out=None):
        """h @ w.T in fp32, for the sampler, into out where given; soft-capped (Gemma 2) where softcap is not 0."""
        out = self.xp.empty((h.shape[0], w.shape[0]), dtype=np.float32) if out is None else out
        cuda_quant.linear(self, self.contiguous(h), w, None, out)
        if softcap:
            out /= np.float32(softcap)
            self.xp.tanh(out, out=out)
            out *= np.float32(softcap)
        return out

    def contiguous(self, x):
        return self.xp.ascontiguousarray(x)

    def embedding(self, table, token_ids, scale: float = 1.0):
        if cuda_quant.is_packed(table):
            return cuda_quant.embedding(self, table, token_ids, scale)
        vocab, hidden = table.shape
        out = self.xp.empty((token_ids.shape[0], hidden), dtype=self.storage_dtype)
        self.kernel("embedding.cu", "embedding")((token_ids.shape[0],), (THREADS,), (
            out, table, self.xp.ascontiguousarray(token_ids, dtype=np.int32), np.int32(hidden), np.int32(vocab),
            np.float32(scale)))
        return out

    def rms_norm(self, x, weight, eps: float):
        x = self.contiguous(x)
        hidden = x.shape[-1]
        out = self.xp.empty_like(x)
        rows = x.size // hidden
        self.kernel("rms_norm.cu", "rms_norm")((rows,), (THREADS,),
                                              (out, x, self.contiguous(weight), np.int32(hidden), np.float32(eps)))
        return out

    def add_rms_norm(self, x, delta, weight, eps: float):
        """NumpyOps.add_rms_norm: x += delta in place, and its norm, in one kernel."""
        if delta is None:
            return x, self.rms_norm(x, weight, eps)
        hidden = x.shape[-1]
        out = self.xp.empty_like(x)
        self.kernel("rms_norm.cu", "add_rms_norm")((x.size // hidden,), (THREADS,), (
            out, x, self.contiguous(delta), weight, np.int32(hidden), np.float32(eps)))
        return x, out

    def rope(self, x, cos, sin):
        out = self.xp.array(x, order="C", copy=True)  # the kernel works in place
        tokens, heads, head_dim = out.shape
        cos, sin = self.xp.ascontiguousarray(cos, dtype=np.float32), self.xp.ascontiguousarray(sin, dtype=np.float32)
        self.kernel("rotary.cu", "rotary")((tokens,), (THREADS,),
                                          (out, out, cos, sin, np.int32(heads), np.int32(0), np.int32(head_dim)))
        return out

    def scale_tokens(self, x, factors):
        out = self.xp.array(x, order="C", copy=True)  # the kernel works in place
        self.kernel("rotary.cu", "scale_tokens")((out.shape[0],), (THREADS,), (
            out, self.xp.ascontiguousarray(factors, dtype=np.float32), np.int32(out.size // max(1, out.shape[0]))))
        return out

    def silu_and_mul(self, gate_up):
        return self._gated(gate_up, "silu_and_mul")

    def gelu_and_mul(self, gate_up):
        return self._gated(gate_up, "gelu_and_mul")

    def _gated(self, gate_up, name: str, *extra):
        gate_up = self.contiguous(gate_up)
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = self.xp.empty((tokens, inter), dtype=self.storage_dtype)
        self.kernel("activation.cu", name)(((inter + THREADS - 1) // THREADS, tokens), (THREADS,),
                                           (out, gate_up, np.int32(inter), *extra))
        return out

    def sigmoid_mul(self, x, gate):
        x = self.contiguous(x)
        tokens, width = x.shape
        out = self.xp.empty_like(x)
        self.kernel("delta_net.cu", "sigmoid_mul")(((width + THREADS - 1) // THREADS, tokens), (THREADS,), (
            out, x, self.contiguous(gate), np.int32(width)))
        return out

    def gated_delta_net(self, proj, weights, shape, history, state, rows, eps: float):
        """NumpyOps.gated_delta_net in cuda/delta_net.cu: the convolution a thread per channel
        and row, then a block per value head and row keeping the state in its slot."""
        xp, proj = self.xp, self.contiguous(proj)
        tokens, projections = proj.shape
        threads = -(-max(shape.key_dim, shape.value_dim) // 32) * 32
        if threads > 256 or shape.conv_kernel > 8:
            raise ModelError(f"the CUDA delta net takes heads of up to 256 and convolutions of up to 8 taps,"
                             f" not {max(shape.key_dim, shape.value_dim)} and {shape.conv_kernel}")
        fresh = xp.asarray(rows.slots[rows.fresh], dtype=np.int64)
        if fresh.size:
            history[fresh], state[fresh] = 0.0, 0.0
        starts, counts, slots = (xp.asarray(a, dtype=np.int32) for a in (rows.starts, rows.counts, rows.slots))
        channels = shape.conv_channels
        mixed = xp.empty((tokens, channels), dtype=np.float32)
        self.kernel("delta_net.cu", "delta_conv")(((channels + THREADS - 1) // THREADS, len(rows.starts)), (THREADS,), (
            mixed, history, proj, weights.conv, starts, counts, slots, np.int32(channels), np.int32(projections),
            np.int32(shape.conv_kernel)))
        out = xp.empty((tokens, shape.values), dtype=self.storage_dtype)
        self.kernel("delta_net.cu", "delta_rule")((shape.value_heads, len(rows.starts)), (threads,), (
            out, state, mixed, proj, weights.dt_bias, weights.decay, weights.norm, starts, counts, slots,
            np.int32(shape.key_heads), np.int32(shape.value_heads), np.int32(shape.key_dim), np.int32(shape.value_dim),
            np.int32(shape.tiled), np.int32(projections), np.float32(eps)))
        return out

    def moe(self, x, experts, gelu: bool = False, router_x=None):
        """NumpyOps.moe in cuda/moe.cu's kernels: routed and sorted on the device, each expert's
        rows a tile of one grouped GEMM per projection, no host round trip."""
        xp, x = self.xp, self.contiguous(x)
        router_x = x if router_x is None else self.contiguous(router_x)
        tokens, hidden = x.shape
        count, k = experts.count, experts.top_k
        routed = tokens * k
        logits = xp.empty((tokens, count), dtype=np.float32)  # a block: 4 experts x 8 tokens, then 4 tokens
        self.kernel("moe.cu", "moe_router")((-(-count // 4), -(-tokens // 8)), (THREADS,), (
            logits, router_x, experts.router, optional(experts.router_bias), np.int32(tokens), np.int32(hidden),
            np.int32(count)))
        ids, weights = xp.empty((tokens, k), dtype=np.int32), xp.empty((tokens, k), dtype=np.float32)
        starts, tile_starts = xp.empty(count + 1, dtype=np.int32), xp.empty(count + 1, dtype=np.int32)
        tokens_of, position = xp.empty(routed, dtype=np.int32), xp.empty(routed, dtype=np.int32)
        self.kernel("moe.cu", "moe_topk")((-(-tokens // 4),), (THREADS,), (  # its last block sorts the rows
            ids, weights, starts, tile_starts, tokens_of, position, xp.zeros(1, dtype=np.int32), logits,
            optional(experts.expert_scale), np.int32(tokens), np.int32(count), np.int32(k),
            np.int32(experts.normalize)))
        tiles = -(-routed // MOE_TILE_ROWS) + min(count, routed)  # at most one part-filled tile an expert

        def grouped(rows, w, bias, gather: bool):
            n = w.shape[0] // count
            out = xp.empty((routed, n), dtype=self.storage_dtype)
            self.kernel("moe.cu", "moe_gemm")((-(-n // MOE_TILE_COLS), tiles), (2 * MOE_TILE_COLS,), (
                out, rows, w, optional(bias), starts, tile_starts, tokens_of, np.int32(gather), np.int32(n),
                np.int32(rows.shape[1]), np.int32(count)))
            return out

        gate_up = grouped(x, cuda_quant.dense(self, experts.gate_up), experts.gate_up_bias, True)
        if experts.swiglu_clamp is not None:
            act = self._gated(gate_up, "clamped_swiglu", *(np.float32(v) for v in experts.swiglu_clamp))
        else:
            act = self.gelu_and_mul(gate_up) if gelu else self.silu_and_mul(gate_up)
        down = grouped(act, cuda_quant.dense(self, experts.down), experts.down_bias, False)
        out = xp.empty((tokens, hidden), dtype=self.storage_dtype)
        self.kernel("moe.cu", "moe_combine")((tokens,), (THREADS,), (
            out, down, weights, position, np.int32(hidden), np.int32(k)))
        if experts.shared_gate is not None:
            shared = self.linear(self.silu_and_mul(self.linear(x, experts.shared_gate_up)), experts.shared_down)
            self.kernel("moe.cu", "moe_shared_add")((tokens,), (THREADS,), (
                out, shared, x, experts.shared_gate, np.int32(hidden)))
        return out

    def write_kv(self, cache_k, cache_v, slots, k, v) -> None:
        tokens, kv_heads, head_dim = k.shape
        cache_slots = cache_k.shape[1] * cache_k.shape[2]
        self.kernel("kv_write.cu", "write_kv")(
            (tokens,), (THREADS,), (cache_k, cache_v, self.contiguous(k), self.contiguous(v),
                                    self.xp.ascontiguousarray(slots, dtype=np.int32), np.int32(kv_heads),
                                    np.int32(head_dim), np.int64(cache_slots)))

    def rope_and_cache(self, qkv, cos, sin, cache_k, cache_v, slots, heads: int, q_norm=None, k_norm=None,
                       v_norm=None, eps: float = 0.0):
        """NumpyOps.rope_and_cache in one kernel of THREADS threads (its norms are rms_norm's bits
        at that width): two rotations, three copies and the K/V write were six launches a layer,
        eleven with q/k norms."""
        kv_heads, blocks, block_size, width = cache_k.shape
        tokens, head_dim = qkv.shape[0], width - (SCALE_BYTES if self.kv_fp8 else 0)  # fp8 rows end in a scale
        q = self.xp.empty((tokens, heads, head_dim), dtype=self.storage_dtype)
        self.kernel("kv_write.cu", "rope_write_kv")((tokens,), (THREADS,), (
            q, cache_k, cache_v, self.contiguous(qkv), self.xp.ascontiguousarray(cos, dtype=np.float32),
            self.xp.ascontiguousarray(sin, dtype=np.float32), optional(q_norm), optional(k_norm), optional(v_norm),
            self.xp.ascontiguousarray(slots, dtype=np.int32), np.int32(heads), np.int32(kv_heads), np.int32(head_dim),
            np.int32(qkv.shape[1]), np.int64(blocks * block_size),
            np.int32(q_norm is not None and q_norm.shape[0] != head_dim), np.float32(eps)))
        return q

    def attention_meta(self, query_lens, context_lens, block_tables, block_size: int) -> AttentionMeta:
        width = max(1, max(len(t) for t in block_tables))
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        return AttentionMeta(decode=all(n == 1 for n in query_lens), query_lens=list(query_lens),
                             query_starts=self.xp.asarray(starts), block_tables=self.xp.asarray(tables),
                             context_lens=self.xp.asarray(np.asarray(context_lens, dtype=np.int32)),
                             max_context=int(max(context_lens)))

    def paged_attention(self, q, cache_k, cache_v, meta: AttentionMeta, scale: float, window: int = 0,
                        softcap: float = 0.0, sinks=None):
        q = self.contiguous(q)
        tokens, heads, head_dim = q.shape
        kv_heads, num_blocks, block_size, _ = cache_k.shape
        seqs = len(meta.query_lens)
        common = (np.int32(heads), np.int32(kv_heads), np.int32(head_dim), np.int32(block_size),
                  np.int32(meta.block_tables.shape[1]), np.int32(num_blocks))
        out = self.xp.empty((tokens, heads, head_dim), dtype=self.storage_dtype)
        if meta.decode:
            launch_decode_attention(self, out, q, cache_k, cache_v, meta, common, scale, window, softcap, optional(sinks))
        else:
            name, rows = self.prefill_kernel(head_dim)
            tiles = -(-max(meta.query_lens) * (heads // kv_heads) // rows)
            kernel = self.kernel(f"{name}.cu", name, prefill_variant(name, head_dim))
            shared = prefill_shared_bytes(name, head_dim, q.itemsize)
            kernel.max_dynamic_shared_size_bytes = shared  # the function's limit: 48 KB less its static by default
            kernel((tiles, seqs, kv_heads), (THREADS,),
                   (out, q, cache_k, cache_v, meta.query_starts, meta.context_lens, meta.block_tables, *common,
                    np.float32(scale), np.int32(window), np.float32(softcap), optional(sinks)), shared_mem=shared)
        return out.reshape(tokens, heads * head_dim)

    def prefill_kernel(self, head_dim: int) -> tuple[str, int]:
        """The prefill attention kernel and the query rows a block of it takes: on tensor cores
        for the 16-bit types and a head_dim in tiles of 16, unless its file did not compile
        here, then on CUDA cores, said once. WMMA's <mma.h> includes crt/mma.h, which a CUDA
        toolkit's headers have and the pip CUDA runtime wheel's lack (NVRTC 13.5, checked
        2026-12-03)."""
        if self.tensor_cores and self.dtype in TENSOR_CORE_TYPES and head_dim % 16 == 0:
            try:
                self.kernel("prefill_attention_tc.cu", "prefill_attention_tc")
                return "prefill_attention_tc", PREFILL_TC_ROWS
            except Exception as e:  # CuPy's CompileException, or a missing header
                self.tensor_cores = False
                log.warning(f"prefill attention stays on CUDA cores: the tensor-core kernel did not compile"
                            f" ({one_line(e)}); it needs the CUDA toolkit's headers (crt/mma.h)")
        return "prefill_attention", PREFILL_ROWS

    def sample(self, logits, batch: SampleBatch) -> SampleResult:
        """NumpyOps.sample's contract; the ids stay on the device (to_host them)."""
        return self.sampler.sample(logits, batch)

    def score(self, logits, token_ids, top: int) -> Scored:
        return self.sampler.score(logits, token_ids, top)

    def release(self, key) -> None:
        """The request named key has ended: its penalty counts' slot is free again."""
        self.sampler.release(key)


def optional(array):
    """A kernel's optional array argument: the array, or a null pointer."""
    return NULL if array is None else array
