"""Paged K/V storage: fixed-size blocks of token slots, addressed only through block tables.

The engine decides which block ids a request holds; this class owns the memory behind them.
Per layer, K and V are (kv_heads, num_blocks, block_size, head_dim) arrays: kv-head-major, so
attention gathers whole blocks and multiplies contiguous matrices. A token at position p of a
request lives in flat slot table[p // block_size] * block_size + p % block_size.
"""

import numpy as np

from model.config import ModelConfig
from model.ops.protocol import Ops

DEFAULT_BLOCK_SIZE = 16


class KVCache:
    def __init__(self, ops: Ops, config: ModelConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        self.ops = ops
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.k = [ops.zeros(shape, ops.storage_dtype) for _ in range(config.num_layers)]
        self.v = [ops.zeros(shape, ops.storage_dtype) for _ in range(config.num_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, itemsize: int = 4) -> int:
        return 2 * config.num_layers * block_size * config.kv_size * itemsize

    def slots(self, block_table, start: int, count: int) -> np.ndarray:
        """Cache slots of positions start .. start + count - 1 of one request."""
        pos = np.arange(start, start + count)
        table = np.asarray(block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def gather_blocks(self, block_ids):
        """Blocks' K and V on the cache's device: (layers, 2, kv_heads, len(block_ids), block_size,
        head_dim)."""
        xp, ids = self.ops.xp, self.ops.asarray(block_ids, np.int64)  # on the cache's device
        return xp.stack([xp.stack([k[:, ids], v[:, ids]]) for k, v in zip(self.k, self.v)])

    def gather_block_major(self, block_ids):
        """Blocks' K and V on the cache's device, block-major: (len(block_ids), layers, 2,
        kv_heads, block_size, head_dim), one contiguous slot a block. Written a layer at a time
        into one array, so a spill (which happens when memory is short) needs its own size plus
        one layer's, where stacking the layers and then moving the axis needed three times it."""
        xp, ids = self.ops.xp, self.ops.asarray(block_ids, np.int64)
        kv_heads, _, block_size, head_dim = self.k[0].shape
        out = xp.empty((len(block_ids), len(self.k), 2, kv_heads, block_size, head_dim), dtype=self.k[0].dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            out[:, layer, 0] = xp.moveaxis(k[:, ids], 1, 0)
            out[:, layer, 1] = xp.moveaxis(v[:, ids], 1, 0)
        return out

    def save_blocks(self, block_ids) -> np.ndarray:
        """Copy blocks to host memory (the spill pool), as gather_blocks lays them out."""
        return self.ops.to_host(self.gather_blocks(block_ids))

    def load_blocks(self, block_ids, data) -> None:
        """Write blocks laid out as gather_blocks does (on the host or the device) back, possibly
        under other block ids."""
        ids = self.ops.asarray(block_ids, np.int64)  # on the cache's device
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[:, ids] = self.ops.asarray(data[layer, 0], data.dtype)
            v[:, ids] = self.ops.asarray(data[layer, 1], data.dtype)
