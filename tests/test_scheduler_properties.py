"""The planner alone under random interleavings of submit, abort, tick, runner failure and KV
pressure, with small pools, against a FakeRunner, and the invariants checked after every tick.

A driver stands in for the engine: it validates at the door, carries out the planner's reloads
and spills through the fake runner, launches and lands steps as the engine's loop does (the
overlapped one included), and applies each sampled token by token ids alone (end-of-generation
id, stop token ids, max_tokens). What tokens mean (text, stop strings, min_tokens, grammars) is
the output processor's, tested with it in test_scheduler.py. An oracle replays each request
alone with the fake runner's next-token function: scheduling, preemption, the prefix cache and
spills must never change what a request gets, only when it gets it.

Checked after every tick:
- blocks held by live requests == blocks the pool counts as used; each request in one place;
  at most max_seqs running; each plan within max_batched_tokens, rows unique, block tables
  covering their positions, fed tokens == the request's own history (AHEAD: the token the step
  in flight samples, only in the overlapped loop)
- the tokens a request got are a prefix of the oracle's (none repeated or skipped), whatever
  ended it; a request is live exactly until it is retired, once, with its end
- admission is strict FIFO: a request leaves the waiting queue only after every one before it
- ends are stop | length | cancelled | error; stop and length match the oracle exactly
  (tokens, reason, stop_reason); usage counts what it got
- an abort of a live request ends it "cancelled" at the next tick; one that arrives during the
  step may instead see it finish there; an id aborted before it is submitted gets "cancelled" and
  no tokens; "cancelled" only ever follows an abort
- "error" only for the rows of a failed runner step, or a request that outgrew the whole pool,
  and then exactly one token past what the pool holds
- every block the prefix cache can hand out holds K/V computed under the prefix that finds it
- a hybrid model's (state slots): a request holds a slot exactly while it holds blocks, each slot
  one request's; a row's slot holds the state of its own history (FakeRunner.carry_state)
- drained (run to idle at the end of every example): pool used 0, swap used 0, slots used 0,
  every request retired, and no abort of a request that was live stays pending
"""

import functools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from app.engine.block_pool import BlockPool
from app.engine.errors import EngineError
from app.engine.moves import carry_out
from app.engine.planner import Planner, PlannerConfig
from app.engine.request import GenerationParams, Request
from app.engine.stats import Stats
from app.engine.validation import validate
from engine_harness import assert_planner_consistent, turn
from fake_runner import FakeRunner
from model.runner import AHEAD
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

REASONS = {"stop", "length", "cancelled", "error"}
INJECTED = "injected runner failure"  # FakeRunner's message

SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def ending(token: int, count: int, params: GenerationParams, max_tokens: int, eos: int):
    """How the count-th token ends its request, by ids alone: (reason, stop_reason), or None."""
    if token == eos and not params.ignore_eos:
        return "stop", None
    if token in params.stop_token_ids:
        return "stop", token
    if count >= max_tokens:
        return "length", None
    return None


def oracle(runner: FakeRunner, prompt, params: GenerationParams, max_tokens: int):
    """What the request gets when it runs to its own end: (tokens, reason, stop_reason)."""
    context, out = list(prompt), []
    while True:
        token = runner.next_token(context)
        out.append(token)
        context.append(token)
        end = ending(token, len(out), params, max_tokens, runner.eos_id)
        if end is not None:
            return (out, *end)


class Driver:
    """The engine's calls around the planner, with results applied by token ids; `ended` holds
    each retired request's (reason, stop_reason, error, tokens, usage), in retirement order."""

    def __init__(self, runner, prefix_caching: bool, **config):
        self.runner = runner
        self.pool = BlockPool(runner.num_blocks, runner.block_size, prefix_caching)
        self.planner = Planner(PlannerConfig(**config), self.pool, Stats())
        self.ended: dict[str, list] = {}
        self.in_flight = None  # (plan, launched)

    def submit(self, prompt, request_id, **params):
        gp = GenerationParams(SamplingParams(temperature=0.0), **params)
        max_tokens = validate(prompt, gp, max_model_len=self.planner.config.max_model_len, pool=self.pool,
                              vocab_size=self.runner.vocab, grammars=None)
        self.planner.add(Request(request_id, list(prompt), gp, max_tokens, emit=None))

    def tick(self):
        p, runner = self.planner, self.runner
        start = p.start_tick()
        waiting = [r.id for r in p.queues.waiting]  # after the aborts: what may be admitted, in order
        self.retire(start.retired)
        carry_out(p, runner, start.moves)
        schedule = p.schedule()
        carry_out(p, runner, schedule.moves)
        plan = schedule.step
        if plan is not None:  # what the output processor gives a row no grammar or budget constrains
            for request, row in zip(schedule.requests, plan.rows):
                row.params = request.params.sampling
        left = {r.id for r in p.queues.waiting}
        admitted = [rid for rid in waiting if rid not in left]
        assert admitted == waiting[:len(admitted)], f"not FIFO: admitted {admitted} from {waiting}"
        self.in_flight = turn(plan, self.in_flight, self.launch, self.land, runner.overlaps)
        self.retire(p.retire())

    def launch(self, plan):
        try:
            return self.runner.launch(plan)
        except AssertionError:
            raise
        except Exception as e:
            self.planner.fail(plan, str(e))

    def land(self, plan, launched):
        by_id = {s.request_id: s.token_id for s in self.runner.collect(launched)}
        for request, row in self.planner.landed(plan):
            token = by_id[row.request_id]
            request.output_ids.append(token)
            end = ending(token, len(request.output_ids), request.params, request.max_tokens, self.runner.eos_id)
            if end is not None:
                self.planner.finish(request, *end)

    def retire(self, retired):
        for request in retired:
            if request.schedule.spilled is not None:
                self.runner.drop_spill(request.schedule.spilled)
            self.runner.release(request.id)
            self.ended.setdefault(request.id, []).append(
                (request.schedule.finish_reason, request.schedule.stop_reason, request.schedule.error,
                 list(request.output_ids),
                 request.usage()))

    def tokens(self, rid):
        request = self.planner.queues.requests.get(rid)
        if request is not None:
            return request.output_ids
        return self.ended[rid][0][3] if rid in self.ended else []


class RecordingRunner(FakeRunner):
    """Checks the plan's shape before the fake forward pass runs."""

    def __init__(self, *args, max_batched_tokens: int, max_seqs: int, **kw):
        super().__init__(*args, **kw)
        self.max_batched_tokens, self.max_seqs = max_batched_tokens, max_seqs
        self.during_step = None  # called once with the plan, as the Engine's other tasks run then

    def launch(self, plan):
        ids = [r.request_id for r in plan.rows]
        assert len(ids) == len(set(ids)), f"a request twice in one step: {ids}"
        assert len(ids) <= self.max_seqs
        assert sum(len(r.token_ids) for r in plan.rows) <= self.max_batched_tokens
        for r in plan.rows:
            known = list(r.prompt_ids) + list(r.output_ids)
            fed = list(r.token_ids)
            if fed == [AHEAD]:  # the token the step in flight samples, at the position after it
                assert self.overlaps and r.sample and r.request_id in self.last_sampled, r
                fed = [self.last_sampled[r.request_id]]
                known.append(fed[0])
            end = r.start_pos + len(fed)
            assert fed and end <= len(r.block_table) * self.block_size, r
            assert fed == known[r.start_pos:end], r
            assert not r.sample or end == len(known), r
        return super().launch(plan)

    def step(self, plan):
        if self.during_step is not None:
            during, self.during_step = self.during_step, None
            during(plan)
        return super().step(plan)


def guarded(method):
    """Remember that a step raised, so teardown does not drain a machine already broken."""

    @functools.wraps(method)
    def wrapper(self, *args, **kw):
        try:
            return method(self, *args, **kw)
        except BaseException:
            self.broken = True
            raise

    return wrapper


class PlannerMachine(RuleBasedStateMachine):
    def __init__(self, tok):
        super().__init__()
        self.tok = tok
        self.h = None  # the Driver
        self.broken = False

    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(2, 4),
                swap_blocks=st.one_of(st.just(0), st.integers(1, 40)), prefix_caching=st.booleans(),
                max_seqs=st.integers(1, 8), prefill_chunk=st.integers(1, 16),
                extra_batch=st.one_of(st.just(1024), st.integers(0, 16)),
                immunity=st.sampled_from([0, 2, 16]), eos_after=st.one_of(st.none(), st.integers(3, 12)),
                alphabet=st.sampled_from([2, 3, 8, 0]),  # 0: the whole vocabulary
                max_model_len=st.one_of(st.just(4096), st.integers(16, 80)), overlaps=st.booleans(),
                state_slots=st.one_of(st.just(0), st.integers(1, 8)))
    @guarded
    def setup(self, num_blocks, block_size, swap_blocks, prefix_caching, max_seqs, prefill_chunk,
              extra_batch, immunity, eos_after, alphabet, max_model_len, overlaps, state_slots):
        eos = self.tok.hf.token_to_id("<|im_end|>")
        mbt = max_seqs + extra_batch
        if state_slots:  # a hybrid model: as the engine configures one (app/engine/engine.py hybrid)
            prefix_caching = False
        self.runner = RecordingRunner(num_blocks, block_size, vocab=self.tok.vocab_size, eos_id=eos,
                                      eos_after=eos_after, max_batched_tokens=mbt, max_seqs=max_seqs,
                                      overlaps=overlaps, state_slots=state_slots)
        self.h = Driver(self.runner, prefix_caching=prefix_caching, max_model_len=max_model_len,
                        max_seqs=max_seqs, max_batched_tokens=mbt, prefill_chunk=prefill_chunk,
                        swap_blocks=swap_blocks, immunity_tokens=immunity, state_slots=state_slots)
        self.alphabet = alphabet or self.tok.vocab_size - self.runner.first_token
        self.bases = [[3 + (i * 7 + k * 13 + i * i * k) % self.alphabet for i in range(40)] for k in range(3)]
        self.histories = []  # prompt + expected output of each request submitted
        self.cap = num_blocks * block_size  # tokens the whole pool holds
        self.subs = {}  # rid -> (prompt, params, max_tokens, oracle)
        self.done = set()  # rids whose end was checked
        self.aborted = set()  # rids aborted while live or before they were submitted
        self.must_cancel = set()  # aborted while live: cancelled by the next tick
        self.pre = []  # aborted before submission, not submitted yet
        self.pre_submitted = set()
        self.failed = set()  # rids in a step the runner failed
        self.n = 0
        self.cache_seen = None
        self.carried = set()  # aborted when not live: the planner may keep these pending
        self.step_aborted = set()  # aborted during the last step

    # -- rules ---------------------------------------------------------------------------------

    def fresh(self, prefix):
        self.n += 1
        return f"{prefix}{self.n}"

    def make_prompt(self, data, lengths):
        length = data.draw(lengths, label="prompt length")
        # prefix-cache traffic: the start of a shared prompt or of an earlier request's prompt and
        # output (a chat's next turn), then a piece of another one spliced in, then tokens of its own
        sources = self.bases + self.histories
        pick = st.integers(0, len(sources) - 1)
        prompt = sources[data.draw(pick, label="head from")][:data.draw(st.integers(0, length), label="head")]
        other = sources[data.draw(pick, label="splice from")]
        at = data.draw(st.integers(0, len(other)), label="splice at")
        prompt += other[at:at + data.draw(st.integers(0, length - len(prompt)), label="splice")]
        rest = length - len(prompt)
        prompt += [3 + t for t in data.draw(st.lists(st.integers(0, self.alphabet - 1), min_size=rest,
                                                     max_size=rest), label="tail")]
        return prompt

    def submit_one(self, data, prompt):
        h = self.h
        length = len(prompt)
        max_tokens = data.draw(st.integers(1, 30), label="max_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        plain = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=ignore_eos)
        tokens, _, _ = oracle(self.runner, prompt, plain, max_tokens)
        stop_ids = data.draw(st.one_of(st.just(()), st.tuples(st.sampled_from(tokens))), label="stop ids")
        rid = self.fresh("q")
        if self.pre and data.draw(st.booleans(), label="pre-aborted id"):
            rid = self.pre.pop(0)
        params = dict(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids)
        limit = h.planner.config.max_model_len
        refused = (length >= limit or h.pool.blocks_for(length + 1) > h.pool.num_blocks
                   or max_tokens > limit - length)
        try:
            h.submit(prompt, rid, **params)
        except EngineError as e:
            assert refused, f"refused a request that fits: {e}"
            if rid.startswith("pre"):
                self.pre.append(rid)
            return
        assert not refused, (length, max_tokens, limit, h.pool.num_blocks)
        gp = GenerationParams(SamplingParams(temperature=0.0), **params)
        self.subs[rid] = (prompt, gp, max_tokens, oracle(self.runner, prompt, gp, max_tokens))
        self.histories.append(prompt + self.subs[rid][3][0])
        if rid.startswith("pre"):
            self.pre_submitted.add(rid)

    @rule(data=st.data())
    @guarded
    def submit(self, data):
        top = max(1, min(40, self.cap - 1))
        self.submit_one(data, self.make_prompt(data, st.one_of(st.integers(1, top), st.integers(1, 40))))

    @rule(data=st.data(), count=st.integers(2, 4))
    @guarded
    def parallel_samples(self, data, count):
        """One prompt submitted several times at once (n > 1): the copies compute the same blocks."""
        top = max(1, min(40, self.cap - 1))
        prompt = self.make_prompt(data, st.integers(1, top))
        for _ in range(count):
            self.submit_one(data, prompt)

    @rule(data=st.data())
    @guarded
    def resubmit(self, data):
        """The start of an earlier request's prompt and output, as it is: a retry, or a chat turn."""
        if self.histories:
            history = data.draw(st.sampled_from(self.histories), label="history")
            self.submit_one(data, history[:data.draw(st.integers(1, min(40, len(history))), label="cut")])

    @rule(data=st.data(), count=st.integers(2, 5))
    @guarded
    def kv_pressure(self, data, count):
        """A burst of long prompts in a small pool: admission stalls, decodes preempt."""
        top = max(1, min(40, self.cap - 1))
        for _ in range(count):
            self.submit_one(data, self.make_prompt(data, st.integers(max(1, top // 2), top)))

    @rule()
    @guarded
    def abort_before_submit(self):
        rid = self.fresh("pre")
        self.h.planner.abort(rid)
        self.pre.append(rid)
        self.aborted.add(rid)

    @rule(data=st.data(), kind=st.sampled_from(
        ["waiting", "prefilling", "decoding", "preempted", "finished", "never-seen"]))
    @guarded
    def abort(self, data, kind):
        s = self.h.planner
        q = s.queues
        where = {"waiting": q.waiting, "prefilling": q.prefilling, "decoding": q.decoding, "preempted": q.preempted}
        if kind in where:
            candidates = sorted(r.id for r in where[kind])
        elif kind == "finished":
            candidates = sorted(self.done)
        else:
            candidates = []
        rid = data.draw(st.sampled_from(candidates), label="abort") if candidates else self.fresh("ghost")
        if rid in q.requests:
            self.must_cancel.add(rid)
            self.aborted.add(rid)
        else:
            self.carried.add(rid)  # never seen, or already gone: the planner cannot tell
        s.abort(rid)

    @rule(row=st.integers(0, 7))
    @guarded
    def abort_during_step(self, row):
        """An abort that arrives while the forward pass runs (a client leaving mid-step): the
        request may finish in that very step, or is cancelled at the next step boundary."""

        def during(plan):
            rid = plan.rows[row % len(plan.rows)].request_id
            self.h.planner.abort(rid)
            self.aborted.add(rid)
            self.step_aborted.add(rid)

        self.runner.during_step = during

    @rule()
    @guarded
    def fail_next_step(self):
        self.runner.fail_steps.add(self.runner.steps + 1)

    @rule(ticks=st.integers(1, 3))
    @guarded
    def tick(self, ticks):
        for _ in range(ticks):
            self.tick_and_check()

    def teardown(self):
        if self.h is None or self.broken:
            return
        for _ in range(20_000):
            if not self.h.planner.has_work and self.h.in_flight is None:
                break
            self.tick_and_check()
        else:
            raise AssertionError("the planner did not go idle")
        s, pool = self.h.planner, self.h.pool
        assert pool.used == 0 and pool.available == pool.num_blocks, pool.used
        assert s.tables.slots is None or s.tables.slots.used == 0, s.tables.slots.free
        q = s.queues
        assert s.preemption.swap_used == 0, s.preemption.swap_used
        assert not (q.waiting or q.prefilling or q.decoding or q.preempted or q.finished or s.in_flight)
        assert self.done == set(self.subs), set(self.subs) - self.done
        assert self.pre_submitted <= self.done
        # an abort stays pending only for an id the planner has not seen live: not for one that
        # was live when aborted and finished before the abort was applied
        stuck = s.aborts - self.carried - set(self.pre)
        assert not stuck, f"aborts pending forever: {stuck}"

    # -- invariants ----------------------------------------------------------------------------

    def probe(self, tokens):
        """The blocks match_prefix would hand out for tokens, leaving the pool as it was."""
        pool = self.h.pool
        refs, evictable = pool.refs[:], pool.evictable.copy()
        hits = pool.match_prefix(tokens)
        pool.refs[:], pool.evictable = refs, evictable
        return hits

    def check_prefix_cache(self):
        """Every block the prefix cache can hand out, on the device or in its host tier, holds
        the K/V of the prefix that finds it: walk all findable chains, built from the tokens the
        cached blocks hold."""
        pool, runner = self.h.pool, self.runner
        if not pool.prefix_caching:
            return
        bs = pool.block_size
        cached = sorted(pool.key_of)
        slots = [b * bs + i for b in cached for i in range(bs)]
        host = list(pool.host.entries.values()) if pool.host is not None else []
        assert all(e.data is not None for e in host), "a host-tier entry is findable before its copy"
        seen = (repr(pool.key_of), repr(pool.block_of), runner.kv[slots].tobytes(),
                runner.ctx[slots].tobytes(), [id(e) for e in host])
        if seen == self.cache_seen:  # nothing changed since the last walk
            return
        self.cache_seen = seen
        contents = {tuple(int(t) for t in runner.kv[b * bs:(b + 1) * bs]) for b in cached}
        contents |= {tuple(int(t) for t in e.data[0]) for e in host}
        frontier = [([], 0)]  # (tokens, the runner's hash chain over them)
        while frontier:
            prefix, chained = frontier.pop()
            for content in contents:
                tokens = prefix + list(content)
                hits = self.probe(tokens + [0])
                if len(hits) * bs != len(tokens):
                    continue
                h = chained
                for p in range(len(prefix), len(tokens)):
                    h = runner.chain(h, tokens[p], p)
                    hit = hits[p // bs]
                    if isinstance(hit, int):
                        slot = runner.slot(hits, p)
                        kv, ctx = runner.kv[slot], runner.ctx[slot]
                    else:  # a host-tier entry: the fake runner's copy of the block's slots
                        kv, ctx = hit.data[0][p % bs], hit.data[1][p % bs]
                    assert kv == tokens[p] and ctx == h, \
                        f"the prefix cache hands out block {hits[-1]} after {prefix}, but its K/V" \
                        f" was computed under another prefix"
                if len(hits) < pool.num_blocks:
                    frontier.append((tokens, h))

    def tick_and_check(self):
        runner = self.runner
        steps = runner.steps
        self.h.tick()  # FIFO admission
        assert_planner_consistent(self.h.planner)  # blocks held == blocks used, one place each, <= max_seqs
        failed = runner.steps > steps and runner.steps in runner.fail_steps
        if failed:
            self.failed.update(runner.rows_seen[-1])
        self.check_prefix_cache()
        s = self.h.planner
        for rid, (prompt, params, max_tokens, (want, reason, stop_reason)) in self.subs.items():
            if rid in self.done:
                continue
            tokens = self.h.tokens(rid)
            assert tokens == want[:len(tokens)], f"{rid}: got {tokens}, expected a prefix of {want}"
            ends = self.h.ended.get(rid, [])
            live = rid in s.queues.requests
            assert len(ends) <= 1 and live != bool(ends), f"{rid}: live={live}, retired {len(ends)} times"
            if not ends:
                assert rid not in self.must_cancel, f"{rid}: aborted, still live a tick later"
                continue
            self.done.add(rid)
            finish_reason, got_stop_reason, error, _, usage = ends[0]
            assert finish_reason in REASONS, finish_reason
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(tokens)
            assert 0 <= usage.cached_tokens < len(prompt)
            if rid in self.must_cancel or rid in self.pre_submitted:
                assert finish_reason == "cancelled", f"{rid}: aborted, ended {finish_reason}"
            if rid in self.pre_submitted:
                assert tokens == [], rid
            if finish_reason in ("stop", "length"):
                got = (tokens, finish_reason, got_stop_reason)
                assert got == (want, reason, stop_reason), \
                    f"{rid}: ended {finish_reason} {got_stop_reason!r} with {tokens}; expected" \
                    f" {reason} {stop_reason!r} with {want}"
            elif finish_reason == "cancelled":
                assert rid in self.aborted, f"{rid}: cancelled, never aborted"
            else:
                if rid in self.failed:
                    assert error == INJECTED, error
                else:  # the only other error: it outgrew the whole pool, one token past its capacity
                    assert "KV cache" in error, error
                    assert len(prompt) + len(tokens) == self.cap + 1, \
                        f"{rid}: KV error at {len(prompt)}+{len(tokens)} tokens; the pool holds {self.cap}"
            if failed and rid in runner.rows_seen[-1]:
                assert finish_reason == "error", f"{rid}: in a failed step, ended {finish_reason}"
        if failed:
            for rid in runner.rows_seen[-1]:
                assert rid in self.done, f"{rid}: in a failed step, still live"
        self.must_cancel -= self.done
        assert not self.must_cancel, f"aborted, still live a tick later: {self.must_cancel}"
        self.must_cancel, self.step_aborted = self.step_aborted - self.done, set()


def test_the_planner_under_random_interleavings(tiny_dir):
    tok = Tokenizer(tiny_dir)  # its vocabulary size and end-of-generation id
    run_state_machine_as_test(lambda: PlannerMachine(tok), settings=SETTINGS)
