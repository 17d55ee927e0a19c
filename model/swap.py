"""The host side of preemption by spill on a GPU: --swap-space GiB of pinned host memory,
allocated once, in slots of one KV block each (every layer's K and V of its tokens).

Spilling gathers the request's blocks into a device array on the step stream; a side stream
waits for that gather and copies each block into a free slot, so neither the host nor the
next step waits for the copy, and the blocks are free for the next step as soon as the gather is
queued (it runs before anything queued after it). Loading makes the step stream wait for that
copy, copies the slots up and scatters them into the new blocks. The scheduler counts the slots
(swap_blocks), so a spill always finds enough free.
"""

from dataclasses import dataclass


@dataclass
class Spill:
    slots: list[int]
    copied: object  # the event after the side stream's copy (None where copies are synchronous)
    gathered: object  # the device array the copy reads: kept alive until the copy is done


class SwapPool:
    def __init__(self, cache, num_slots: int):
        self.cache, self.ops = cache, cache.ops
        self.launcher = self.ops.launcher
        first = cache.kv_layers[0][0]  # a hybrid's delta-net layers keep none
        self.host = self.launcher.pinned(num_slots * cache.block_floats, first.dtype).reshape(num_slots, -1)
        self.free = list(range(num_slots - 1, -1, -1))

    def save(self, block_ids) -> Spill:
        gathered = self.cache.gather_blocks(block_ids)  # one slot a block
        slots = [self.free.pop() for _ in block_ids]
        copied = self.launcher.copy_to_host(gathered, [self.host[s] for s in slots])
        return Spill(slots, copied, gathered)

    def load(self, block_ids, spill: Spill) -> None:
        """The spilled blocks back under block_ids (as many as were saved)."""
        data = self.launcher.copy_to_device([self.host[s] for s in spill.slots], spill.copied)
        self.cache.load_blocks(block_ids, data)

    def release(self, spill: Spill) -> None:
        """The slots are free again: a later copy into them runs after this one on the side stream."""
        self.free.extend(spill.slots)
