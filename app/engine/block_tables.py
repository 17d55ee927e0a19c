"""Each request's block table against the pool: taken for a prefill, grown to cover a position,
offered to the prefix cache as blocks fill, freed behind a sliding window, trimmed after rejected guesses.

Where every layer slides (window: Mistral's, Phi-3's), a request's blocks wholly before the
window of its next query are freed as its steps land (drop_outside_window), so a long request
holds at most window / block_size + 1 blocks once its prompt is in; its rows' tables keep the
logical positions, the freed entries pointing at its first held block, which attention never
weighs (every key there is outside the window). A step in flight may still read a freed block;
a later step, which the device runs after it, is the first that can write it.
"""

from app.engine.block_pool import BlockPool
from app.engine.request import Request, State
from app.engine.state_slots import StateSlots


class BlockTables:
    def __init__(self, pool: BlockPool, window: int = 0, slots: StateSlots | None = None):
        self.pool = pool
        self.slots = slots  # a hybrid model's: a request holds a state slot while it holds blocks
        # the positions back every layer attends to; blocks freed behind it (0: never). A window
        # of a block or less is not freed behind: the prefix cache names a block by its parent.
        self.window = window if window > pool.block_size else 0

    def covered(self, request: Request) -> int:
        """Positions its table reaches, the freed leading blocks included."""
        s = request.schedule
        return (s.dropped_blocks + len(s.block_table)) * self.pool.block_size

    def take(self, request: Request, tokens: list[int], target: int, host: bool = True) -> bool:
        """Its table for a prefill: the cached prefix of tokens, and fresh blocks for the rest of
        target tokens; False (and nothing held) when the pool cannot hold them. A waiting request
        scoring its prompt takes no cached block: a scored position must be computed. Blocks
        matched in the host tier (unless host is False) get fresh blocks and a load each; the
        request is not planned until those are done (schedule.host_loads), and they are offered
        to the device cache again as its first step lands."""
        s = request.schedule
        if self.slots is not None and s.state_slot is None:
            s.state_slot = self.slots.take()
            if s.state_slot is None:
                return False
        scores = request.params.prompt_logprobs is not None and s.state is State.WAITING
        hits = [] if scores else self.pool.match_prefix(tokens, host, cache_root(request))
        device = [b for b in hits if isinstance(b, int)]
        host_hits = [(i, e) for i, e in enumerate(hits) if not isinstance(e, int)]
        for _, entry in host_hits:  # before allocating, whose evictions could drop them
            self.pool.host.claim(entry)
        fresh = self.pool.allocate_many(self.pool.blocks_for(target) - len(device))
        if fresh is None:
            self.release_slot(request)
            self.pool.release(device)
            for _, entry in host_hits:
                self.pool.host.unclaim(entry)
            return False
        fresh = iter(fresh)
        table = [hit if isinstance(hit, int) else next(fresh) for hit in hits]
        s.block_table, s.dropped_blocks = table + list(fresh), 0
        s.num_computed = len(hits) * self.pool.block_size
        s.num_offered = host_hits[0][0] * self.pool.block_size if host_hits else s.num_computed
        admitted = s.state is State.WAITING
        for index, entry in host_hits:
            self.pool.adopted[table[index]] = entry.ident
            self.pool.host.load(request, index, table[index], entry, s.host_epoch, admitted)
        s.host_loads = len(host_hits)
        if admitted:
            s.cached_tokens = s.num_computed
            s.host_cached = len(host_hits) * self.pool.block_size
        return True

    def grow(self, request: Request, position: int) -> bool:
        """Allocate blocks until its table covers position; False when the pool ran out first
        (the blocks taken so far stay)."""
        while self.covered(request) <= position:
            block = self.pool.allocate()
            if block is None:
                return False
            request.schedule.block_table.append(block)
        return True

    def release(self, request: Request) -> None:
        self.pool.release(request.schedule.block_table)
        request.schedule.block_table = []
        self.release_slot(request)

    @property
    def slot_free(self) -> bool:
        """Whether a request could take a state slot now (always, for a model without them)."""
        return self.slots is None or bool(self.slots.free)

    def release_slot(self, request: Request) -> None:
        if request.schedule.state_slot is not None:
            self.slots.release(request.schedule.state_slot)
            request.schedule.state_slot = None

    def trim(self, request: Request) -> None:
        """The blocks past its next row's position go back (written by rejected guesses)."""
        s = request.schedule
        keep = self.pool.blocks_for(request.num_tokens) - s.dropped_blocks
        if len(s.block_table) > keep:
            self.pool.release(s.block_table[keep:])
            del s.block_table[keep:]

    def table(self, request: Request) -> list[int]:
        """The request's block table by logical block: its freed leading entries pointing at its
        first held block (a fresh list then, so a planned row keeps its own)."""
        s = request.schedule
        if not s.dropped_blocks:
            return s.block_table
        return [s.block_table[0]] * s.dropped_blocks + s.block_table

    def offer_full_blocks(self, request: Request) -> None:
        """Blocks filled since the last offer go to the prefix cache (skipped when none did:
        building the token history for every row of every step is not free)."""
        s = request.schedule
        if s.num_computed - s.num_offered >= self.pool.block_size:
            s.num_offered = self.pool.cache_full_blocks(self.table(request), request.all_ids, s.num_offered,
                                                        s.num_computed, cache_root(request))

    def drop_outside_window(self, request: Request) -> None:
        """Free the leading blocks no later query sees: every position in them is at least
        window before the next one computed (after their offer to the prefix cache)."""
        s = request.schedule
        drop = (s.num_computed - self.window + 1) // self.pool.block_size - s.dropped_blocks
        drop = min(drop, len(s.block_table) - 1)  # the table keeps a block to point at
        if self.window and drop > 0:
            self.pool.release(s.block_table[:drop])
            s.block_table = s.block_table[drop:]
            s.dropped_blocks += drop


def cache_root(request: Request):
    """The parent its first block is cached under: -1, or its LoRA adapter's own root."""
    adapter = request.params.adapter
    return -1 if adapter is None else adapter.cache_root
