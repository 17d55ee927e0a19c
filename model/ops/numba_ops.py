"""The fast CPU backend: NumbaOps, numba kernels for the ops that hold a step's time, and NumPy
(NumpyOps, which it inherits, the oracle) for everything else.

Float32 GEMMs stay with OpenBLAS, which does them best; 8-bit and 4-bit weights multiply
in model/quant/. The kernels, by concern: model/ops/numba_rowwise.py (norms, rotary, SiLU, the
K/V write), model/ops/numba_attention.py, model/ops/numba_sampler.py; how they compile:
model/ops/numba_kernels.py. OpenBLAS's worker threads spin for a while after each call, and so
do numba's: model/__init__.py shortens both before NumPy loads.
"""

import logging

import numpy as np

from model.choices import KV_CACHE_TYPES
from model.errors import ModelError
from model.ops import delta_rule, numba_attention, numba_delta_rule, numba_lora, numba_rowwise, numba_sampler
from model.ops.moe import ExpertPlan, router_logits
from model.ops.numba_kernels import QUANTIZED_KV
from model.ops.numpy_ops import NumpyOps, into, soft_capped
from model.ops.protocol import SampleBatch, SampleResult
from model.quant import blocks, pack
from model.quant.gemv import grouped_gemv
from model.quant.matmul import matmul
from model.quant.quantized import Fused, QuantizedTensor
from model.quant.strips import STRIP, Strips

log = logging.getLogger("spool.model")


class NumbaOps(NumpyOps):
    """weights: what the 2-D float weights are kept as. float32 (--dtype float32): float32
    weights and K/V, the exact path. q8_0: every weight whose rows split into blocks of 32 in
    Q8_0 (model/quant/): the projections, the embedding and the LM head; Q4_1 instead where a
    weight is exactly that. q4_k: those whose rows split into super-blocks of 256 quantized to
    Q4_K by Spool's own quantizer (model/quant/kquants.py), the others as q8_0 keeps them.
    Either way a GGUF's quantized tensors are packed from their own blocks where
    model/quant/blocks.py has a packer for the kind (and this CPU the kernels), else
    dequantized and rounded to Q8_0; and K/V are float16 (float32 on a CPU without F16C:
    model/ops/numba_kernels.QUANTIZED_KV), or q8_0 where kv says so (model/kv_cache.py).
    activations: what the packed weights' GEMV rounds each block of 32 activations to
    (model/quant/gemv.py): int8 as llama.cpp does (one vpdpbusd for 64 products with VNNI), or
    int16 (closer to float32, half the products an instruction); model/backend.py chooses by the
    model's size."""

    name = "numba"
    # measured on a 2-core Xeon, a Llama-3.2-1B Q4_K_M prompt of 4,096 tokens: the tiled
    # attention's float32 multiply-adds take about 2.5 times the packed integer GEMMs' each
    attention_cost = 2.5
    WEIGHTS = ("float32", *pack.KINDS)
    ACTIVATIONS = {"int8": np.int8, "int16": np.int16}
    write_kv = staticmethod(numba_rowwise.write_kv)
    rms_norm = staticmethod(numba_rowwise.rms_norm)
    add_rms_norm = staticmethod(numba_rowwise.add_rms_norm)
    rope = staticmethod(numba_rowwise.rope)
    silu_and_mul = staticmethod(numba_rowwise.silu_and_mul)
    gelu_and_mul = staticmethod(numba_rowwise.gelu_and_mul)
    lora = staticmethod(numba_lora.lora)

    def __init__(self, weights: str = "float32", activations: str = "int8", kv: str = "f16"):
        super().__init__()
        if weights not in self.WEIGHTS:
            raise ValueError(f"the CPU keeps weights as {', '.join(self.WEIGHTS)}, not {weights}")
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"the CPU rounds activations to {', '.join(self.ACTIVATIONS)}, not {activations}")
        if kv not in KV_CACHE_TYPES or kv == "q8_0" and weights == "float32":
            raise ValueError(f"the CPU keeps K/V as {' or '.join(KV_CACHE_TYPES)} (q8_0 beside packed weights), not"
                             f" {kv} beside {weights} weights")
        self.weights, self.activations, self.kv_q8_0 = weights, activations, kv == "q8_0"
        self.storage_dtype = np.dtype(np.float32) if weights == "float32" else QUANTIZED_KV
        self.converted: set[str] = set()  # GGUF types rounded to Q8_0 since the last loaded()

    def weight(self, x):
        if self.weights == "float32":
            return super().weight(x)
        if isinstance(x, Fused):
            parts = tuple(self.weight(part) for part in x.parts)
            return blocks.stacked(parts) or Fused(parts)
        if isinstance(x, QuantizedTensor):
            kept = blocks.from_gguf(x)
            if kept is not None:
                return kept
            self.converted.add(x.kind)
            return blocks.to_q8_0(x)
        return pack.compress(x, self.weights) if pack.quantizable(x) else super().weight(x)

    def loaded(self) -> None:
        """One line for the whole model naming the GGUF types that lost their own blocks."""
        if self.converted:
            log.info(f"GGUF types {', '.join(sorted(self.converted))} have no kept kernels here;"
                     " converted to q8_0")
            self.converted.clear()

    def embedding(self, table, token_ids: np.ndarray, scale: float = 1.0) -> np.ndarray:
        if isinstance(table, Strips):
            rows = table.dequantize(token_ids)
            if scale != 1.0:
                rows *= np.float32(scale)
            return rows
        return super().embedding(table, token_ids, scale)

    def linear(self, x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
        if isinstance(w, Fused) and all(isinstance(p, Strips) for p in w.parts):
            out = matmul(x, w.parts, self.ACTIVATIONS[self.activations])
        elif isinstance(w, Fused):
            out = np.concatenate([self.linear(x, part) for part in w.parts], axis=1)
        elif not isinstance(w, Strips):
            return super().linear(x, w, bias)
        else:
            out = matmul(x, w, self.ACTIVATIONS[self.activations])
        if bias is not None:
            out += bias
        return out

    def router_logits(self, x: np.ndarray, router: np.ndarray) -> np.ndarray:
        return router_logits(np.ascontiguousarray(x), router)

    def grouped_linear(self, rows: np.ndarray, w, plan: ExpertPlan) -> np.ndarray:
        """Packed experts in one kernel call for all of them (model/quant/gemv.py); float32 ones
        as NumpyOps multiplies them."""
        if not isinstance(w, Strips):
            return super().grouped_linear(rows, w, plan)
        if w.rows % (plan.experts * STRIP):
            raise ModelError(f"experts of {w.rows // plan.experts} rows do not fill whole strips of {STRIP};"
                             " run this model with --dtype float32")
        return grouped_gemv(np.ascontiguousarray(rows, dtype=np.float32), w, plan.experts, plan.starts,
                            plan.active, self.ACTIVATIONS[self.activations])

    def logits(self, h: np.ndarray, w, softcap: float = 0.0, out=None) -> np.ndarray:
        """The LM head, C-ordered: at 8 rows and up h @ w.T is as fast as NumpyOps' (w @ h.T).T."""
        if isinstance(w, Strips):
            logits = matmul(h, w, self.ACTIVATIONS[self.activations])
        else:
            logits = h @ w.T if h.shape[0] >= 8 else np.ascontiguousarray(self.linear(h, w))
        return into(out, soft_capped(logits, softcap))

    def attention_meta(self, query_lens, context_lens, block_tables, block_size: int) -> numba_attention.AttentionPlan:
        return numba_attention.AttentionPlan(list(query_lens), list(context_lens), block_tables, block_size)

    def gated_delta_net(self, proj, weights, shape, history, state, rows, eps: float) -> np.ndarray:
        return delta_rule.gated_delta_net(proj, weights, shape, history, state, rows, eps,
                                          numba_delta_rule.convolve_rows, numba_delta_rule.delta_rule_rows)

    def paged_attention(self, q, cache_k, cache_v, meta: numba_attention.AttentionPlan, scale: float,
                        window: int = 0, softcap: float = 0.0, sinks=None) -> np.ndarray:
        return numba_attention.paged_attention(q, cache_k, cache_v, meta, scale, window, softcap, sinks)

    def sample(self, logits: np.ndarray, batch: SampleBatch) -> SampleResult:
        """NumpyOps.sample's contract; the plain rows drawn in one kernel (model/ops/numba_sampler.py)."""
        return numba_sampler.sample(logits, batch, super().sample)
