"""Decode attention's launch plan (cuda/decode_attention.cu): which instance a model takes, how
a row's context splits, and how many blocks run the splits.

A row's context splits into at most `decode_splits` parts of at least DECODE_MIN_SPLIT tokens,
from its own length only, and each part's partial is computed the same way whichever block takes
it; so a row's output is the same bits whatever the batch, and a graph's launch (sized by its
padded batch and the model's constants) computes what an eager step would."""

import numpy as np

from model.ops.kernels import decode_variant

THREADS = 128
DECODE_MIN_SPLIT = 64  # context tokens a decode part takes at least: 4 warps of 16 rows
DECODE_BLOCKS_AN_SM = 4  # resident decode blocks a multiprocessor (__launch_bounds__(128, 4))


def decode_splits(multiprocessors: int, blocks: int) -> int:
    """The most parts a sequence's context is split into for decode attention, given its blocks a
    split (decode_blocks): enough blocks for two per multiprocessor at batch 1, so a long context
    keeps the whole GPU busy. Fixed for a model on a device, so a row's split (and its result)
    never depends on the batch, and a decode graph's partials are sized by this, not by
    max_model_len."""
    return max(1, min(64, -(-2 * multiprocessors // blocks)))


def decode_blocks(heads: int, kv_heads: int, head_dim: int, dtype: str = "float32",
                  cache: str | None = None) -> tuple[tuple[int, int, int], int]:
    """decode_attention's instance for a model, and its blocks a sequence and split: one per KV
    head and chunk of the KV head's query heads."""
    group = heads // kv_heads
    instance = decode_variant(group, head_dim, dtype, cache)
    return instance, kv_heads * -(-group // instance[0])


def split_blocks(seqs: int, blocks: int, splits: int, multiprocessors: int) -> int:
    """The grid's blocks a (sequence, KV head chunk), each looping over its share of the splits:
    enough to fill every multiprocessor's resident blocks once, no more (a block's partials do
    not depend on this, only how many a block computes)."""
    return max(1, min(splits, -(-DECODE_BLOCKS_AN_SM * multiprocessors // (seqs * blocks))))


def launch_decode_attention(ops, out, q, cache_k, cache_v, meta, common: tuple, scale: float, window: int,
                            softcap: float, sinks) -> None:
    """Both kernels into out (seqs, heads, head_dim): every part's partial, then the reduce.
    common: the (heads, kv_heads, head_dim, block_size, max_blocks, num_blocks) int32 arguments;
    sinks: the reduce's sinks argument (an array or a null pointer)."""
    seqs, heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    keys = min(meta.max_context, window) if window else meta.max_context
    instance, blocks = decode_blocks(heads, kv_heads, head_dim, ops.dtype, ops.cache)
    multiprocessors = ops.launcher.multiprocessors
    splits = min(decode_splits(multiprocessors, blocks), -(-keys // DECODE_MIN_SPLIT))
    part_max = ops.xp.empty((seqs, heads, splits), dtype=np.float32)
    part_sum = ops.xp.empty((seqs, heads, splits), dtype=np.float32)
    part_acc = ops.xp.empty((seqs, heads, splits, head_dim), dtype=np.float32)
    ops.kernel("decode_attention.cu", "decode_attention", instance)(
        (blocks, seqs, split_blocks(seqs, blocks, splits, multiprocessors)), (THREADS,),
        (part_max, part_sum, part_acc, q, cache_k, cache_v, meta.block_tables, meta.context_lens, *common,
         np.int32(DECODE_MIN_SPLIT), np.int32(splits), np.float32(scale), np.int32(window), np.float32(softcap)))
    ops.kernel("decode_attention.cu", "decode_attention_reduce")(
        (heads, seqs), (THREADS,), (out, part_max, part_sum, part_acc, np.int32(heads), np.int32(head_dim),
                                    np.int32(splits), sinks))
