"""How many KV blocks fit on the GPU under --gpu-memory-utilization, sized as vLLM sizes them.

With the weights loaded, one profiling step as large as the scheduler may ever plan
(--max-batched-tokens tokens over --max-seqs rows, every row sampled) runs on a throwaway cache.
CuPy's memory pool keeps what that step allocated, so the device's used memory afterwards is the
CUDA context, the weights and the peak of a step's activations together. Whatever is left under
the fraction of the device's total goes to the KV pool, less what is held beside every step: the
decode graphs' one logits buffer (model/cuda_graphs.py), allocated after the KV cache. A draft
model (model/draft.py) is loaded before the profile, so its weights are measured with the
target's, and its K/V of as many blocks shares the pool: a block costs both models' bytes.
"""

from dataclasses import dataclass

from model.cuda_graphs import logits_bytes
from model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from model.ops import cuda_quant
from model.runner import ModelRunner, Row, StepPlan
from model.weights import open_tensors

GIB = 1 << 30


@dataclass
class MemoryPlan:
    total: int  # bytes on the device
    used: int  # context, weights and a step's peak activations
    budget: int  # total x utilization
    block_bytes: int
    held: int = 0  # allocated after the KV cache and kept: the decode graphs' logits buffer

    @property
    def num_blocks(self) -> int:
        return max(0, (self.budget - self.used - self.held) // self.block_bytes)

    def describe(self) -> str:
        return (f"{self.used / GIB:.2f} GiB for the weights and a step's activations, {self.held / GIB:.2f} GiB for"
                f" the decode graphs' logits, {self.budget / GIB:.2f} GiB allowed of {self.total / GIB:.2f} GiB")


def profile_plan(max_seqs: int, max_batched_tokens: int, max_model_len: int, block_size: int) -> StepPlan:
    """The largest step: max_batched_tokens tokens shared by max_seqs sampled rows, each within
    max_model_len, on consecutive blocks of a throwaway cache."""
    rows, tokens, next_block = [], max_batched_tokens, 0
    for i in range(max_seqs):
        n = min(max(1, tokens // (max_seqs - i)), max_model_len - 1)
        blocks = -(-n // block_size)
        rows.append(Row(f"profile-{i}", [0] * n, 0, list(range(next_block, next_block + blocks)), sample=True))
        tokens, next_block = tokens - n, next_block + blocks
    return StepPlan(rows)


def pool_block_bytes(ops, config, block_size: int, extra_layers: int = 0, draft=None) -> int:
    """A block of the KV pool: the model's K/V (with extra_layers beyond its own), and a draft
    model's where one mirrors it (its cache has as many blocks, model/draft.py)."""
    draft_bytes = 0 if draft is None else KVCache.bytes_per_block_of(ops, draft.config, block_size)
    return KVCache.bytes_per_block_of(ops, config, block_size, extra_layers) + draft_bytes


def plan_kv_cache(model, utilization: float, max_seqs: int, max_batched_tokens: int, max_model_len: int,
                  block_size: int = DEFAULT_BLOCK_SIZE, extra_layers: int = 0, graphs: bool = False,
                  draft=None) -> MemoryPlan:
    """Run the profiling step, then measure while the memory pool still holds what the step
    allocated. The throwaway cache's blocks are not counted as used: the pool hands its memory
    back to the device before the KV cache is allocated. graphs: decode graphs will be captured;
    draft: a draft model already on the device, whose cache takes as many blocks."""
    launcher, config = model.ops.launcher, model.config
    plan = profile_plan(max_seqs, max_batched_tokens, max_model_len, block_size)
    num_blocks = sum(len(r.block_table) for r in plan.rows)
    runner = ModelRunner(config, model, num_blocks, block_size)
    runner.step(plan)
    for row in plan.rows:
        runner.release(row.request_id)
    del runner
    launcher.synchronize()
    free, total = launcher.memory_info()
    launcher.release_cached()  # the throwaway cache's memory goes back, for the real one to take
    block_bytes = pool_block_bytes(model.ops, config, block_size, extra_layers, draft)
    used = total - free - num_blocks * KVCache.bytes_per_block_of(model.ops, config, block_size)
    return MemoryPlan(total=total, used=used, budget=int(total * utilization), block_bytes=block_bytes,
                      held=logits_bytes(max_seqs, model.w.lm_head.shape[0]) if graphs else 0)


def gpu_kv_blocks(model, utilization: float, max_seqs: int, max_batched_tokens: int, max_model_len: int,
                  block_size: int = DEFAULT_BLOCK_SIZE, extra_layers: int = 0, graphs: bool = False,
                  draft=None) -> int:
    """The KV pool's size in blocks (each with extra_layers' K/V beyond the model's), or a
    ValueError of one line that says which flag to change."""
    lower = f"lower --max-batched-tokens ({max_batched_tokens}) and --max-seqs ({max_seqs})"
    try:
        memory = plan_kv_cache(model, utilization, max_seqs, max_batched_tokens, max_model_len, block_size,
                               extra_layers, graphs, draft)
    except MemoryError as e:  # CuPy's OutOfMemoryError is one
        raise ValueError(f"out of GPU memory in the profiling step ({e}); {lower}") from None
    if memory.num_blocks < 2:
        raise ValueError(f"no room for the KV cache on the GPU: {memory.describe()}; raise --gpu-memory-utilization"
                         f" (now {utilization:g}) or {lower}")
    if memory.num_blocks * block_size < max_model_len:
        raise ValueError(f"the KV cache holds {memory.num_blocks * block_size} tokens ({memory.describe()}), fewer"
                         f" than one request of --max-model-len {max_model_len}; lower --max-model-len or raise"
                         f" --gpu-memory-utilization (now {utilization:g})")
    return memory.num_blocks


def planned_weight_bytes(tensors, dtype: str) -> int:
    """What a model's weights will take on the GPU, from each (type, shape) alone, before any is
    read: a GGUF's packed types their blocks (model/ops/cuda_quant.py), the rest their values in
    the storage type (a router's float32 counted so too: a few MB)."""
    return sum(cuda_quant.device_bytes(kind.lower(), shape, dtype) for kind, shape in tensors)


def model_weight_bytes(model_dir, dtype: str) -> int:
    """planned_weight_bytes of a model directory's tensors (a GGUF's types, safetensors' floats)."""
    with open_tensors(model_dir) as tensors:
        return planned_weight_bytes(((e.tensor.tensor_type.name if hasattr(e, "tensor") else e.dtype, e.shape)
                                     for e in tensors.entries.values()), dtype)
