"""Drives the Scheduler tick by tick, synchronously, with the invariants checked after every
tick: the same order of calls the Engine makes, minus Trio."""

from app.engine.block_pool import BlockPool
from app.engine.request import GenerationParams, Request, State
from app.engine.scheduler import Scheduler, SchedulerConfig
from model.sampling import SamplingParams


class Harness:
    def __init__(self, runner, tokenizer, prefix_caching: bool = True, **config):
        config.setdefault("max_model_len", 4096)
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.block_size, prefix_caching)
        self.s = Scheduler(SchedulerConfig(**config), self.pool, runner, tokenizer)
        self.frames: dict[str, list] = {}
        self.count = 0
        self.running = None  # (plan, launched) while a step is in flight: the overlapped loop

    def submit(self, prompt, request_id=None, closed=False, **params) -> str:
        params.setdefault("sampling", SamplingParams(temperature=0.0))
        gp = GenerationParams(**params)
        max_tokens = self.s.check(list(prompt), gp)
        self.count += 1
        rid = request_id or f"r{self.count}"
        frames = self.frames.setdefault(rid, [])

        def emit(frame):
            if closed:
                raise RuntimeError("closed")
            frames.append(frame)

        self.s.add(Request(rid, list(prompt), gp, max_tokens, emit))
        return rid

    def tick(self) -> None:
        """One turn of Engine._tick_loop: the overlapped loop when the runner overlaps."""
        plan = self.s.schedule()
        if plan is None:
            self.land(*self.running)
            self.running = None
        else:
            launched = self.launch(plan) if plan.rows else None
            landed, self.running = self.running, None
            if landed is not None:
                self.land(*landed)
            if launched is not None:
                if getattr(self.runner, "overlaps", False):
                    self.running = (plan, launched)
                else:
                    self.land(plan, launched)
        self.s.flush()
        self.check()

    def launch(self, plan):
        try:
            return self.runner.launch(plan)
        except AssertionError:  # the fake runner caught a wrong block table: a test failure
            raise
        except Exception as e:
            self.s.fail(plan, str(e))

    def land(self, plan, launched) -> None:
        self.s.apply(plan, self.runner.collect(launched))

    def check(self) -> None:
        """Blocks held by live requests are exactly the blocks the pool counts as used, and
        every request is in exactly one place."""
        self.pool.check(self.s.held_blocks())
        s = self.s
        places = [*s.waiting, *s.prefilling, *s.decoding, *s.preempted]
        assert len(places) == len(set(id(r) for r in places)) == len(s.requests)
        for r in s.waiting:
            assert r.state is State.WAITING and not r.block_table
        for r in s.preempted:
            assert r.state is State.PREEMPTED and not r.block_table
        for r in [*s.prefilling, *s.decoding]:
            assert len(r.block_table) * self.pool.block_size >= r.target
        assert s.running <= s.config.max_seqs
        for rid, frames in self.frames.items():
            finals = [f for f in frames if f.finish_reason is not None]
            assert len(finals) <= 1 and (not finals or frames[-1] is finals[0]), rid

    def run(self, max_ticks: int = 10_000) -> None:
        for _ in range(max_ticks):
            if not self.s.has_work and self.running is None:
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
