"""Drives the Engine tick by tick, synchronously, with the invariants checked after every tick:
the same calls its tick loop makes (next_step, launch, land, retire), minus Trio."""

from app.engine import Engine, EngineConfig
from app.engine.request import GenerationParams, Request, State
from model.sampling import SamplingParams


def turn(plan, in_flight, launch, land, overlaps: bool):
    """One turn of Engine._tick_loop's launch and land order; returns the step left in flight
    ((plan, launched), or None). plan None: only landing the step in flight makes room."""
    if plan is None:
        land(*in_flight)
        return None
    launched = launch(plan) if plan.rows else None
    if in_flight is not None:
        land(*in_flight)
    if launched is None:
        return None
    if overlaps:
        return plan, launched
    land(plan, launched)
    return None


class Harness:
    def __init__(self, runner, tokenizer, prefix_caching: bool = True, **config):
        config.setdefault("max_model_len", 4096)
        self.runner = runner
        self.engine = Engine(runner, tokenizer, EngineConfig(prefix_caching=prefix_caching, decode_log_interval=0,
                                                             **config))
        self.planner, self.outputs = self.engine.planner, self.engine.outputs
        self.pool, self.stats = self.engine.pool, self.engine.stats
        self.frames: dict[str, list] = {}
        self.count = 0
        self.in_flight = None  # (plan, launched) while a step is in flight: the overlapped loop

    def submit(self, prompt, request_id=None, closed=False, **params) -> str:
        params.setdefault("sampling", SamplingParams(temperature=0.0))
        gp = GenerationParams(**params)
        max_tokens = self.engine.validate(list(prompt), gp)
        self.count += 1
        rid = request_id or f"r{self.count}"
        frames = self.frames.setdefault(rid, [])

        def emit(frame):
            if closed:
                raise RuntimeError("closed")
            frames.append(frame)

        self.engine.add(Request(rid, list(prompt), gp, max_tokens, emit))
        return rid

    def tick(self) -> None:
        """One turn of Engine._tick_loop: the overlapped loop when the runner overlaps."""
        plan = self.engine.next_step()
        self.in_flight = turn(plan, self.in_flight, self.launch, self.land, self.engine.overlaps)
        self.engine.retire()
        self.assert_consistent()

    def launch(self, plan):
        try:
            return self.runner.launch(plan)
        except AssertionError:  # the fake runner caught a wrong block table: a test failure
            raise
        except Exception as e:
            self.engine.fail_step(plan, str(e))

    def land(self, plan, launched) -> None:
        self.engine.apply(plan, self.runner.collect(launched))

    def assert_consistent(self) -> None:
        """Blocks held by live requests are exactly the blocks the pool counts as used, and
        every request is in exactly one place."""
        assert_planner_consistent(self.planner)
        for rid, frames in self.frames.items():
            finals = [f for f in frames if f.finish_reason is not None]
            assert len(finals) <= 1 and (not finals or frames[-1] is finals[0]), rid

    def run(self, max_ticks: int = 10_000) -> None:
        for _ in range(max_ticks):
            if not self.planner.has_work and self.in_flight is None:
                return
            self.tick()
        raise AssertionError("did not go idle")

    def tokens(self, rid) -> list[int]:
        return [t for f in self.frames[rid] for t in f.token_ids]

    def text(self, rid) -> str:
        return "".join(f.text for f in self.frames[rid])

    def final(self, rid):
        finals = [f for f in self.frames[rid] if f.finish_reason is not None]
        assert len(finals) == 1, f"{rid}: {len(finals)} final frames"
        return finals[0]


def held_blocks(planner) -> dict[int, int]:
    held = {}
    for request in planner.queues.requests.values():
        for block in request.schedule.block_table:
            held[block] = held.get(block, 0) + 1
    return held


def assert_planner_consistent(p) -> None:
    """Blocks held by live requests are exactly the blocks the pool counts as used, each request
    is in exactly one place, and at most max_seqs run."""
    p.pool.assert_consistent(held_blocks(p))
    q = p.queues
    places = [*q.waiting, *q.prefilling, *q.decoding, *q.preempted]
    assert len(places) == len(set(id(r) for r in places)) == len(q.requests)
    for r in q.waiting:
        assert r.schedule.state is State.WAITING and not r.schedule.block_table
    for r in q.preempted:
        assert r.schedule.state is State.PREEMPTED and not r.schedule.block_table
    for r in [*q.prefilling, *q.decoding]:
        assert (r.schedule.dropped_blocks + len(r.schedule.block_table)) * p.pool.block_size >= r.target
    assert q.num_running <= p.config.max_seqs
    slots = p.tables.slots
    if slots is None:
        assert all(r.schedule.state_slot is None for r in q.requests.values())
    else:  # a hybrid model's: a slot exactly while it holds blocks, each slot held once
        for r in q.requests.values():
            assert (r.schedule.state_slot is not None) == bool(r.schedule.block_table), r.id
        slots.assert_consistent([r.schedule.state_slot for r in q.requests.values()
                                 if r.schedule.state_slot is not None])
