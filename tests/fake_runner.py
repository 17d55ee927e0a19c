"""A runner with the real contract and no model: its "KV cache" stores the token id written at
each slot, and the next token is a function of the context it reads back through the block
table. So a request's tokens do not depend on scheduling, and any block-table, prefix-cache or
spill mistake changes them."""

import threading
import time
from dataclasses import replace

import numpy as np

from model.runner import AHEAD, Sampled, StepPlan


class FakeRunner:
    """launch() does the step's work at once (step()); overlaps=True has the engine run its
    overlapped loop on it, where a row fed AHEAD takes the token the last launch sampled."""

    def __init__(self, num_blocks: int, block_size: int = 4, vocab: int = 400, first_token: int = 3,
                 step_cost: float = 0.0, eos_id: int | None = None, eos_after: int | None = None,
                 overlaps: bool = False, state_slots: int = 0):
        self.num_blocks, self.block_size = num_blocks, block_size
        # a hybrid model's: per slot, (the hash chain of the tokens its state has seen, how many)
        self.state_slots = state_slots
        self.states: dict[int, tuple[int, int]] = {}
        self.vocab, self.first_token = vocab, first_token
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.ctx = np.zeros(num_blocks * block_size, dtype=np.int64)  # per slot: hash of the prefix
        self.step_cost = step_cost
        self.scripts: dict[tuple, list[int]] = {}  # prompt -> the tokens to generate for it
        self.fail_steps: set[int] = set()  # step numbers that raise
        self.eos_id, self.eos_after = eos_id, eos_after
        self.steps = 0
        self.rows_seen: list[list] = []  # per step, the request ids planned
        self.released: list = []  # request ids, in the order the engine said they ended
        self.lock = threading.Lock()
        self.overlaps = overlaps
        self.last_sampled: dict = {}  # request id -> the token the last launch sampled for it
        self.ahead_rows = 0  # rows fed AHEAD

    def launch(self, plan: StepPlan) -> list[Sampled]:
        rows = []
        for row in plan.rows:
            if row.token_ids[0] == AHEAD:
                self.ahead_rows += 1
                row = replace(row, token_ids=[self.last_sampled[row.request_id]])
            rows.append(row)
        sampled = self.step(StepPlan(rows))
        self.last_sampled = {s.request_id: s.token_id for s in sampled}
        return sampled

    @staticmethod
    def collect(launched: list[Sampled]) -> list[Sampled]:
        return launched

    def next_token(self, context: list[int]) -> int:
        for prompt, script in self.scripts.items():
            if tuple(context[:len(prompt)]) == prompt and len(context) >= len(prompt):
                done = len(context) - len(prompt)
                return script[done] if done < len(script) else (self.eos_id if self.eos_id is not None else 3)
        if self.eos_after is not None and len(context) % self.eos_after == 0:
            return self.eos_id
        span = self.vocab - self.first_token
        return self.first_token + (hash((len(context), tuple(context[-3:]))) % span)

    def slot(self, table, pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, plan: StepPlan) -> list[Sampled]:
        with self.lock:
            self.steps += 1
            self.rows_seen.append([r.request_id for r in plan.rows])
            if self.step_cost:
                time.sleep(self.step_cost)
            if self.steps in self.fail_steps:
                raise RuntimeError("injected runner failure")
            out = []
            slots = [row.state_slot for row in plan.rows]
            assert not self.state_slots or len(set(slots)) == len(slots), f"rows share a state slot: {slots}"
            for row in plan.rows:
                table = row.block_table
                h = int(self.ctx[self.slot(table, row.start_pos - 1)]) if row.start_pos else 0
                if self.state_slots:
                    self.carry_state(row, h)
                for i, token in enumerate(row.token_ids):
                    h = self.chain(h, token, row.start_pos + i)
                    self.kv[self.slot(table, row.start_pos + i)] = token
                    self.ctx[self.slot(table, row.start_pos + i)] = h
                if row.sample:
                    end = row.start_pos + len(row.token_ids)
                    context = [int(self.kv[self.slot(table, p)]) for p in range(end)]
                    assert -1 not in context, f"{row.request_id} read a slot nobody wrote"
                    h = 0
                    for p, token in enumerate(context):
                        h = self.chain(h, token, p)
                        assert h == self.ctx[self.slot(table, p)], \
                            f"{row.request_id} read K/V at position {p} computed under another prefix"
                    token = self.next_token(context)
                    bias = row.params.logit_bias.get(token, 0.0)
                    if bias <= -100:  # min_tokens bans: take the next id instead
                        token = self.first_token + (token + 1 - self.first_token) % (self.vocab - self.first_token)
                    out.append(Sampled(row.request_id, token))
            return out

    def carry_state(self, row, h: int) -> None:
        """A hybrid row reads its slot's state: it must be what the request's own history left
        there (zeros at a prompt's start), then holds the row's tokens too."""
        assert row.state_slot is not None and 0 <= row.state_slot < self.state_slots, row
        if row.start_pos:
            assert self.states.get(row.state_slot) == (h, row.start_pos), \
                f"{row.request_id} read a delta-net state computed under another history"
        for i, token in enumerate(row.token_ids):
            h = self.chain(h, token, row.start_pos + i)
        self.states[row.state_slot] = (h, row.start_pos + len(row.token_ids))

    @staticmethod
    def chain(h: int, token: int, pos: int) -> int:
        return hash((h, token, pos))

    def release(self, request_id) -> None:
        self.released.append(request_id)

    def save_state(self, slot: int):
        return self.states.get(slot)

    def load_state(self, slot: int, state) -> None:
        self.states[slot] = state

    def save_blocks(self, block_ids):
        slots = [b * self.block_size + i for b in block_ids for i in range(self.block_size)]
        return self.kv[slots].copy(), self.ctx[slots].copy()

    def load_blocks(self, block_ids, data):
        slots = [b * self.block_size + i for b in block_ids for i in range(self.block_size)]
        self.kv[slots], self.ctx[slots] = data

    def drop_spill(self, data):
        pass

    def expected(self, prompt: list[int], count: int, stop_ids=()) -> list[int]:
        """The tokens a request gets when nothing goes wrong."""
        context, out = list(prompt), []
        while len(out) < count:
            token = self.next_token(context)
            out.append(token)
            context.append(token)
            if token in stop_ids:
                break
        return out
