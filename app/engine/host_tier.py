"""The prefix cache's host tier: cached blocks the pool evicts go to the host spill pool instead
of being dropped, still findable under the same key, so an agent's next turn reloads its long
prefix instead of recomputing it after other requests crowded it out of the device.

An entry keeps the identity (ident) its block was cached under, so its children, on the device
or here, still name it as their parent; a block it is reloaded into takes that identity over
(BlockPool.ident_of). Entries leave least recently used first when the host pool needs room.

Room is shared with preemption's spills, which come first: a spill may evict host-tier entries,
an eviction from the device never evicts a spill (it is dropped when only spills fill the pool).
Every decision appends a move (HostSave, HostLoad, HostDrop) to the planner's one ordered list,
which the engine carries out in that order with preemption's Spill and Reload before the step:
so a save reads a block before a later load writes it, and the host slots a decision counts as
free are free when its copy runs.
"""

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class Entry:
    key: tuple  # (parent ident or -1, token ids): the block's key in the pool
    ident: tuple  # what its children name as their parent
    data: object = None  # the host copy, once the engine saved it (the runner's; the engine drops it)


@dataclass
class HostSave:
    """Copy an evicted device block into its entry, before any later move or step reuses it."""

    block: int
    entry: Entry


@dataclass
class HostLoad:
    """Copy an entry into a fresh block of a request's table (at index), then drop the copy."""

    request: object
    index: int
    block: int
    entry: Entry
    epoch: int  # the request's schedule.host_epoch when queued: a later one makes this load stale
    counted: bool  # its tokens were counted as prefix-cache hits at admission


@dataclass
class HostDrop:
    """An entry left the host tier: drop its copy."""

    entry: Entry


@dataclass
class HostTier:
    capacity: int  # the host spill pool, in blocks
    moves: list  # the planner's ordered moves, shared with preemption
    reserved: object  # () -> blocks preemption's spills hold
    entries: OrderedDict = field(default_factory=OrderedDict)  # hash of key -> Entry, LRU first
    claimed: int = 0  # entries matched, whose loads are not queued yet: their room stays taken

    @property
    def used(self) -> int:
        return self.reserved() + len(self.entries) + self.claimed

    def find(self, key: tuple) -> Entry | None:
        entry = self.entries.get(hash(key))
        return entry if entry is not None and entry.key == key else None

    def offer(self, block: int, key: tuple, ident: tuple) -> None:
        """A cached device block is being evicted: saved here when there is room, or room
        made by dropping the least recently used entries."""
        h = hash(key)
        if h in self.entries:  # a copy under this key (or a colliding one) is here already
            return
        while self.used >= self.capacity and self.entries:
            self._drop_lru()
        if self.used < self.capacity:
            entry = Entry(key, ident)
            self.entries[h] = entry
            self.moves.append(HostSave(block, entry))

    def make_room(self, blocks: int) -> bool:
        """Room for a preemption spill of this many blocks (not yet counted in reserved),
        dropping entries as needed; False when spills alone leave too little."""
        if self.reserved() + self.claimed + blocks > self.capacity:
            return False
        while self.used + blocks > self.capacity:
            self._drop_lru()
        return True

    def claim(self, entry: Entry) -> None:
        """Matched: out of the index, its room held until its load is queued (load) or it is
        put back (unclaim)."""
        del self.entries[hash(entry.key)]
        self.claimed += 1

    def unclaim(self, entry: Entry) -> None:
        self.claimed -= 1
        self.entries[hash(entry.key)] = entry

    def load(self, request, index: int, block: int, entry: Entry, epoch: int, counted: bool) -> None:
        self.claimed -= 1
        self.moves.append(HostLoad(request, index, block, entry, epoch, counted))

    def lost(self, entry: Entry) -> None:
        """Its save failed: no longer findable (a load already queued for it fails too)."""
        if self.entries.get(hash(entry.key)) is entry:
            del self.entries[hash(entry.key)]

    def flush(self) -> int:
        """Drop every entry; how many."""
        count = len(self.entries)
        while self.entries:
            self._drop_lru()
        return count

    def _drop_lru(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.moves.append(HostDrop(entry))

    def assert_consistent(self) -> None:
        assert self.claimed == 0, "a matched entry was neither loaded nor put back"
        assert self.used <= self.capacity, (self.used, self.capacity)
        assert all(hash(e.key) == h for h, e in self.entries.items())
