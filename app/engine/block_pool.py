"""Which KV block ids are free, held or cached: the engine's side of the paged cache.

The prefix cache lives here. A full block is keyed by (parent block, its token ids); a hit is
confirmed by comparing both, so a hash collision can never hand a request the wrong K/V. The
parent is named by its id and its generation (bumped each time the id is handed out), so a child
cached under a parent whose id was since reused for other tokens is never found again.
Blocks are refcounted; an unreferenced cached block stays findable until it is evicted, least
recently used first, when a fresh block is needed.
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
        self.key_of: dict[int, tuple] = {}  # cached block -> ((parent, its gen) or -1, token ids)
        self.block_of: dict[int, int] = {}  # hash of key -> cached block

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
            self._forget(block)
        else:
            return None
        self.refs[block] = 1
        self.gen[block] += 1
        return block

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
        """Forget every cached block no request holds (they become free); how many."""
        flushed = list(self.evictable)
        for block in flushed:
            self._forget(block)
            self.free.append(block)
        self.evictable.clear()
        return len(flushed)

    def match_prefix(self, token_ids) -> list[int]:
        """Cached blocks holding the longest prefix of token_ids, each now referenced once more.
        Only full blocks match, and at least one token is always left to compute, so the
        request still gets logits."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        parent = -1
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            key = (parent, tuple(token_ids[start:start + bs]))
            block = self.block_of.get(hash(key))
            if block is None or self.key_of[block] != key:
                break
            hits.append(block)
            parent = (block, self.gen[block])
        for block in hits:
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
        return hits

    def cache_full_blocks(self, block_table, token_ids, num_cached: int, num_computed: int) -> int:
        """Offer the blocks that became full between num_cached and num_computed tokens to the
        prefix cache; returns the new number of offered tokens (a block-size multiple)."""
        bs = self.block_size
        if not self.prefix_caching:
            return num_computed - num_computed % bs
        for index in range(num_cached // bs, num_computed // bs):
            block = block_table[index]
            parent = (block_table[index - 1], self.gen[block_table[index - 1]]) if index else -1
            key = (parent, tuple(token_ids[index * bs:(index + 1) * bs]))
            h = hash(key)
            if block not in self.key_of and h not in self.block_of:
                self.key_of[block] = key
                self.block_of[h] = block
        return num_computed - num_computed % bs

    def _forget(self, block: int) -> None:
        key = self.key_of.pop(block)
        h = hash(key)
        if self.block_of.get(h) == block:
            del self.block_of[h]

    def assert_consistent(self, held: dict[int, int]) -> None:
        """Invariants, for tests: held maps block -> how many live requests hold it."""
        for block in range(self.num_blocks):
            assert self.refs[block] == held.get(block, 0), (block, self.refs[block], held.get(block, 0))
        assert len(set(self.free)) == len(self.free)
        assert not set(self.free) & set(self.evictable)
        assert all(self.refs[b] == 0 for b in self.free) and all(self.refs[b] == 0 for b in self.evictable)
        assert all(b in self.key_of for b in self.evictable) and not any(b in self.key_of for b in self.free)
        assert self.used == sum(1 for r in self.refs if r > 0)
