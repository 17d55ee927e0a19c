"""A hybrid model's state slots: each running request of a model with delta-net layers holds one
slot of recurrent state (model/kv_cache.py owns the memory, the engine which request holds
which). A request takes its slot with its blocks and gives it back with them: a preempted
request recomputes its state from its token history, as it recomputes its K/V."""


class StateSlots:
    def __init__(self, count: int):
        self.count = count
        self.free = list(range(count - 1, -1, -1))  # pop() takes 0 first

    @property
    def used(self) -> int:
        return self.count - len(self.free)

    def take(self) -> int | None:
        """A free slot, or None when every slot is held."""
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.count and slot not in self.free, f"state slot {slot} released twice"
        self.free.append(slot)

    def assert_consistent(self, held: list[int]) -> None:
        """held: the slots live requests hold; each held once, and exactly the ones not free."""
        assert len(held) == len(set(held)) and set(held).isdisjoint(self.free), (held, self.free)
        assert len(held) == self.used, (held, self.used)
