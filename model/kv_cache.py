"""Paged K/V storage: fixed-size blocks of token slots, addressed only through block tables;
and, for a hybrid model's delta-net layers, one state slot per running request.

The engine decides which block ids and which state slot a request holds; this class owns the
memory behind them. Per attention layer, K and V are (kv_heads, num_blocks, block_size,
head_dim) arrays: kv-head-major, so attention gathers whole blocks and multiplies contiguous
matrices. With q8_0 K/V (ops.kv_q8_0, --cache-type-k q8_0 on the CPU) they are int8 and
(kv_heads, num_blocks, block_size, head_dim + SCALE_BYTES): each token's head vector as
round(x / s), s = max |x| / 127, with s's float32 bytes in the same block (the kernels' layout:
model/ops/numba_rowwise.write_kv), so a block is still one run of one dtype and moves, spills and
reloads as float blocks do. With fp8 K/V on CUDA (ops.kv_fp8, --kv-cache-dtype fp8) they are
uint8 of the same shape: each token's head vector as OCP FP8 E4M3 codes of x / s, s = max |x| /
448, and s's float32 bytes after them; K token-major as V (cuda/kv_write.cu). A token at
position p of a request lives in flat slot table[p // block_size] * block_size + p % block_size.
A layer that reads an earlier layer's K/V (Gemma 4's last ones) keeps none (None in the K/V
lists). Per delta-net layer (None too), a slot holds the recurrent state (value_heads, key_dim,
value_dim) and the convolution's last inputs (conv_kernel - 1, conv_channels), float32 on every
backend: the state is summed into at every token, for as long as the request lives.
"""

from dataclasses import dataclass

import numpy as np

from model.config import ModelConfig
from model.ops.protocol import SCALE_BYTES, Ops

DEFAULT_BLOCK_SIZE = 16


@dataclass
class StateRows:
    """Each row of a step that carries delta-net state: where its tokens lie in the step, its
    slot, and whether it starts a prompt (its slot is zeroed first)."""

    starts: np.ndarray  # int64 (rows,): the row's first token in the step
    counts: np.ndarray  # int64 (rows,)
    slots: np.ndarray  # int64 (rows,)
    fresh: np.ndarray  # bool (rows,)
    inputs: dict | None = None  # row index -> a list the forward pass appends (layer, its inputs) to (rewind.py)

    def keep(self, layer: int, proj) -> None:
        """The rows' fused input projections of a delta-net layer, kept where asked."""
        for row, kept in (self.inputs or {}).items():
            start = int(self.starts[row])
            kept.append((layer, proj[start:start + int(self.counts[row])].copy()))


class KVCache:
    def __init__(self, ops: Ops, config: ModelConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 state_slots: int = 0, extra_layers: int = 0):
        """extra_layers: full-attention layers after the model's (its MTP layer, model/mtp.py)."""
        self.ops = ops
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.state_slots = state_slots if config.delta_net else 0
        fp8 = getattr(ops, "kv_fp8", False)
        keeps, extra = set(config.attention_layers), SCALE_BYTES if ops.kv_q8_0 or fp8 else 0
        shapes = [(config.kv_heads_of(i), num_blocks, block_size, config.head_dim_of(i) + extra) if i in keeps
                  else None for i in range(config.num_layers)]
        shapes += [(config.num_kv_heads, num_blocks, block_size, config.head_dim + extra)] * extra_layers
        dtype = np.dtype(np.int8) if ops.kv_q8_0 else np.dtype(np.uint8) if fp8 else ops.storage_dtype
        self.k = [None if shape is None else ops.zeros(shape, dtype) for shape in shapes]
        self.v = [None if shape is None else ops.zeros(shape, dtype) for shape in shapes]
        net = config.delta_net
        self.conv = [ops.zeros((self.state_slots, net.conv_kernel - 1, net.conv_channels)) if config.linear(i)
                     else None for i in range(config.num_layers)]
        self.recurrent = [ops.zeros((self.state_slots, net.value_heads, net.key_dim, net.value_dim))
                          if config.linear(i) else None for i in range(config.num_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, itemsize: int = 4,
                        extra_layers: int = 0, q8_0: bool = False) -> int:
        """itemsize: a float K/V element's bytes; q8_0 (or fp8, the same size): one byte an element
        and SCALE_BYTES a token's head vector."""
        if q8_0:
            heads = sum(map(config.kv_heads_of, config.attention_layers)) + extra_layers * config.num_kv_heads
            return KVCache.bytes_per_block(config, block_size, 1, extra_layers) + 2 * heads * block_size * SCALE_BYTES
        floats = sum(map(config.kv_size_of, config.attention_layers)) + extra_layers * config.kv_size
        return 2 * floats * block_size * itemsize

    @staticmethod
    def bytes_per_block_of(ops: Ops, config: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE,
                           extra_layers: int = 0) -> int:
        """bytes_per_block for K/V as ops keeps them."""
        return KVCache.bytes_per_block(config, block_size, ops.storage_dtype.itemsize, extra_layers,
                                       ops.kv_q8_0 or getattr(ops, "kv_fp8", False))

    @staticmethod
    def bytes_per_state_slot(config: ModelConfig) -> int:
        """One request's delta-net state over every such layer (float32); 0 for other models."""
        if config.delta_net is None:
            return 0
        return 4 * config.delta_net.state_floats * sum(map(config.linear, range(config.num_layers)))

    @property
    def kv_layers(self) -> list[tuple]:
        return [(k, v) for k, v in zip(self.k, self.v) if k is not None]

    def slots(self, block_table, start: int, count: int) -> np.ndarray:
        """Cache slots of positions start .. start + count - 1 of one request."""
        pos = np.arange(start, start + count)
        table = np.asarray(block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @property
    def block_floats(self) -> int:
        """One block's K and V over every layer that keeps them."""
        return sum(2 * k[:, 0].size for k, _ in self.kv_layers)

    def block_parts(self):
        """Each layer's K, then its V, with its columns of a block's flat row (gather_blocks' layout)."""
        at = 0
        for k, v in self.kv_layers:
            for part in (k, v):
                size = part[:, 0].size
                yield part, slice(at, at + size)
                at += size

    def gather_blocks(self, block_ids):
        """Blocks' K and V on the cache's device, block-major: (len(block_ids), block_floats), each
        block's layers in order, a layer's K then V, each (kv_heads, block_size, head_dim). Flat,
        so that layers of different shapes (Gemma 4's) share one layout; written a layer at a
        time, so a spill (which happens when memory is short) needs its own size plus one layer's."""
        xp, ids = self.ops.xp, self.ops.asarray(block_ids, np.int64)  # on the cache's device
        out = xp.empty((len(block_ids), self.block_floats), dtype=self.kv_layers[0][0].dtype)
        for part, columns in self.block_parts():
            out[:, columns] = xp.moveaxis(part[:, ids], 1, 0).reshape(len(block_ids), -1)
        return out

    def save_blocks(self, block_ids) -> np.ndarray:
        """Copy blocks to host memory (the spill pool), as gather_blocks lays them out."""
        return self.ops.to_host(self.gather_blocks(block_ids))

    def load_blocks(self, block_ids, data) -> None:
        """Write blocks laid out as gather_blocks does (on the host or the device) back, possibly
        under other block ids."""
        ids = self.ops.asarray(block_ids, np.int64)  # on the cache's device
        for part, columns in self.block_parts():
            block = (len(block_ids), part.shape[0], *part.shape[2:])
            part[:, ids] = self.ops.xp.moveaxis(self.ops.asarray(data[:, columns], data.dtype).reshape(block), 0, 1)

    def save_state(self, slot: int) -> list:
        """A slot's delta-net state copied to the host (a preempted request's spill)."""
        return [(self.ops.to_host(c[slot]).copy(), self.ops.to_host(r[slot]).copy())
                for c, r in zip(self.conv, self.recurrent) if c is not None]

    def load_state(self, slot: int, saved: list) -> None:
        """save_state's copy written back, possibly into another slot."""
        layers = [(c, r) for c, r in zip(self.conv, self.recurrent) if c is not None]
        for (c, r), (conv, recurrent) in zip(layers, saved):
            c[slot], r[slot] = self.ops.asarray(conv), self.ops.asarray(recurrent)
