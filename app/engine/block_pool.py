"""Which KV block ids are free, held or cached: the engine's side of the paged cache.

The prefix cache lives here. A full block is keyed by (parent block, its token ids); a hit is
confirmed by comparing both, so a hash collision can never hand a request the wrong K/V. The
parent is named by its id and its generation (bumped each time the id is handed out), so a child
cached under a parent whose id was since reused for other tokens is never found again.
Blocks are refcounted; an unreferenced cached block stays findable until it is evicted, least
recently used first, when a fresh block is needed. With a host tier (host_tier.py) an evicted
block is saved to the host instead of dropped, and a match continues there: a block reloaded
from it takes over the identity its entry was cached under (ident), so its children still match.
"""

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self.gen = [0] * num_blocks  # how many times each block was handed out
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never cached; pop() takes 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.key_of: dict[int, tuple] = {}  # cached block -> (its parent's ident_of or -1, token ids)
        self.block_of: dict[int, int] = {}  # hash of key -> cached block
        self.adopted: dict[int, tuple] = {}  # block -> the ident of the host entry reloaded into it
        self.host = None  # a HostTier, set by the planner when there is a host spill pool

    @property
    def available(self) -> int:
        """Blocks a request could get now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks

    def allocate(self) -> int | None:
        """A block with refcount 1, or None when the pool is dry."""
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            key = self._forget(block)
            if self.host is not None:
                self.host.offer(block, key, self.ident_of(block))
        else:
            return None
        self.adopted.pop(block, None)
        self.refs[block] = 1
        self.gen[block] += 1
        return block

    def ident_of(self, block: int) -> tuple:
        """What its children's keys name it by: its id and generation, or the identity of the
        host entry reloaded into it."""
        return self.adopted.get(block) or (block, self.gen[block])

    def allocate_many(self, count: int) -> list[int] | None:
        """count blocks, or None (and nothing taken) when fewer are available."""
        if count > self.available:
            return None
        return [self.allocate() for _ in range(count)]

    def release(self, blocks) -> None:
        for block in blocks:
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} released twice"
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def flush(self) -> int:
        """Forget every cached block no request holds (they become free) and the host tier's;
        how many."""
        flushed = list(self.evictable)
        for block in flushed:
            self._forget(block)
            self.free.append(block)
        self.evictable.clear()
        return len(flushed) + (self.host.flush() if self.host is not None else 0)

    def match_prefix(self, token_ids, host: bool = True, root=-1) -> list:
        """The longest cached prefix of token_ids, a block at a time: a device block (an int, now
        referenced once more) or, where the device has none, a host-tier Entry (for the caller
        to claim; host False: the device's blocks alone). Only full blocks match, and at least
        one token is always left to compute, so the request still gets logits. root: what the
        first block's key names as its parent: -1, or a LoRA adapter's (lora.AdapterUse.cache_root),
        so that K/V computed under one adapter never serves another."""
        if not self.prefix_caching:
            return []
        hits: list = []
        parent = root
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            key = (parent, tuple(token_ids[start:start + bs]))
            block = self.block_of.get(hash(key))
            if block is not None and self.key_of[block] == key:
                hits.append(block)
                parent = self.ident_of(block)
                continue
            entry = self.host.find(key) if host and self.host is not None else None
            if entry is None:
                break
            hits.append(entry)
            parent = entry.ident
        for block in hits:
            if isinstance(block, int):
                if self.refs[block] == 0:
                    del self.evictable[block]
                self.refs[block] += 1
        return hits

    def cache_full_blocks(self, block_table, token_ids, num_cached: int, num_computed: int, root=-1) -> int:
        """Offer the blocks that became full between num_cached and num_computed tokens to the
        prefix cache; returns the new number of offered tokens (a block-size multiple)."""
        bs = self.block_size
        if not self.prefix_caching:
            return num_computed - num_computed % bs
        for index in range(num_cached // bs, num_computed // bs):
            block = block_table[index]
            parent = self.ident_of(block_table[index - 1]) if index else root
            key = (parent, tuple(token_ids[index * bs:(index + 1) * bs]))
            h = hash(key)
            if block not in self.key_of and h not in self.block_of:
                self.key_of[block] = key
                self.block_of[h] = block
        return num_computed - num_computed % bs

    def _forget(self, block: int) -> tuple:
        key = self.key_of.pop(block)
        h = hash(key)
        if self.block_of.get(h) == block:
            del self.block_of[h]
        return key

    def assert_consistent(self, held: dict[int, int]) -> None:
        """Invariants, for tests: held maps block -> how many live requests hold it."""
        for block in range(self.num_blocks):
            assert self.refs[block] == held.get(block, 0), (block, self.refs[block], held.get(block, 0))
        assert len(set(self.free)) == len(self.free)
        assert not set(self.free) & set(self.evictable)
        assert all(self.refs[b] == 0 for b in self.free) and all(self.refs[b] == 0 for b in self.evictable)
        assert all(b in self.key_of for b in self.evictable) and not any(b in self.key_of for b in self.free)
        assert self.used == sum(1 for r in self.refs if r > 0)
        if self.host is not None:
            self.host.assert_consistent()
