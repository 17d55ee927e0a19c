"""The scheduler under random interleavings of submit, abort, tick, runner failure and KV pressure,
with small pools, against a FakeRunner, and the invariants checked after every tick.

An oracle replays each request alone, with the fake runner's next-token function and the
scheduler's own stop rules (min_tokens bans, end-of-generation set, stop token ids, stop strings
through the same detokenizer and matcher): scheduling, preemption, the prefix cache and spills
must never change what a request gets, only when it gets it.

Checked after every tick (Harness.check, plus):
- blocks held by live requests == blocks the pool counts as used; each request in one place;
  at most max_seqs running; each plan within max_batched_tokens, rows unique, block tables
  covering their positions, fed tokens == the request's own history
- the tokens and text sent to a request are a prefix of the oracle's (none repeated or skipped),
  whatever ended it; a request is live exactly until its one final frame, which is last
- finish reasons are stop | length | cancelled | error; stop and length match the oracle exactly
  (tokens, text, reason, stop_reason); usage counts what was sent
- an abort of a live request ends it "cancelled" at the next tick; one that arrives during the
  step may instead see it finish there; an id aborted before it is submitted gets "cancelled" and
  no tokens; "cancelled" only ever follows an abort
- "error" only for the rows of a failed runner step, or a request that outgrew the whole pool,
  and then exactly one token past what the pool holds
- every block the prefix cache can hand out holds K/V computed under the prefix that finds it
- drained (run to idle at the end of every example): pool used 0, swap used 0, every request
  has its final frame, and no abort of a request that was live stays pending
"""

import functools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from app.engine.request import GenerationParams
from app.engine.scheduler import EngineError
from app.engine.stops import StopMatcher
from engine_harness import Harness
from fake_runner import FakeRunner
from model.runner import AHEAD
from model.sampling import SamplingParams
from model.tokenizer import IncrementalDetokenizer, Tokenizer

REASONS = {"stop", "length", "cancelled", "error"}
INJECTED = "injected runner failure"  # FakeRunner's message

SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def oracle(runner: FakeRunner, tok, prompt, params: GenerationParams, max_tokens: int):
    """What the request gets when it runs to its own end: (tokens, text, reason, stop_reason)."""
    eos = tok.eos_token_ids
    span = runner.vocab - runner.first_token
    detok, stops = IncrementalDetokenizer(tok, prompt), StopMatcher(params.stop)
    context, out, text = list(prompt), [], ""
    while True:
        token = runner.next_token(context)
        if len(out) < params.min_tokens:  # the fake runner takes the next id when a ban hits
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
            if token in banned:
                token = runner.first_token + (token + 1 - runner.first_token) % span
        out.append(token)
        context.append(token)
        may_stop = len(out) > params.min_tokens
        if may_stop and token in eos and not params.ignore_eos:  # held-back text is released
            return out, text + stops.feed(detok.flush())[0] + stops.flush(), "stop", None
        if may_stop and token in params.stop_token_ids:
            return out, text + stops.feed(detok.flush())[0] + stops.flush(), "stop", token
        piece, stop = detok.add(token), None
        if may_stop:
            piece, stop = stops.feed(piece)
        text += piece
        if stop is not None:
            return out, text, "stop", stop
        if len(out) >= max_tokens:
            return out, text + stops.feed(detok.flush())[0] + stops.flush(), "length", None


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


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self, tok):
        super().__init__()
        self.tok = tok
        self.h = None
        self.broken = False

    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(2, 4),
                swap_blocks=st.one_of(st.just(0), st.integers(1, 40)), prefix_caching=st.booleans(),
                max_seqs=st.integers(1, 8), prefill_chunk=st.integers(1, 16),
                extra_batch=st.one_of(st.just(1024), st.integers(0, 16)),
                immunity=st.sampled_from([0, 2, 16]), eos_after=st.one_of(st.none(), st.integers(3, 12)),
                alphabet=st.sampled_from([2, 3, 8, 0]),  # 0: the whole vocabulary
                max_model_len=st.one_of(st.just(4096), st.integers(16, 80)), overlaps=st.booleans())
    @guarded
    def setup(self, num_blocks, block_size, swap_blocks, prefix_caching, max_seqs, prefill_chunk,
              extra_batch, immunity, eos_after, alphabet, max_model_len, overlaps):
        eos = self.tok.hf.token_to_id("<|im_end|>")
        mbt = max_seqs + extra_batch
        self.runner = RecordingRunner(num_blocks, block_size, vocab=self.tok.vocab_size, eos_id=eos,
                                      eos_after=eos_after, max_batched_tokens=mbt, max_seqs=max_seqs,
                                      overlaps=overlaps)
        self.h = Harness(self.runner, self.tok, prefix_caching=prefix_caching, max_model_len=max_model_len,
                         max_seqs=max_seqs, max_batched_tokens=mbt, prefill_chunk=prefill_chunk,
                         swap_blocks=swap_blocks, immunity_tokens=immunity)
        self.alphabet = alphabet or self.tok.vocab_size - self.runner.first_token
        self.bases = [[3 + (i * 7 + k * 13 + i * i * k) % self.alphabet for i in range(40)] for k in range(3)]
        self.histories = []  # prompt + expected output of each request submitted
        self.cap = num_blocks * block_size  # tokens the whole pool holds
        self.subs = {}  # rid -> (prompt, params, max_tokens, oracle)
        self.done = set()  # rids whose final frame was checked
        self.aborted = set()  # rids aborted while live or before they were submitted
        self.must_cancel = set()  # aborted while live: cancelled by the next tick
        self.pre = []  # aborted before submission, not submitted yet
        self.pre_submitted = set()
        self.failed = set()  # rids in a step the runner failed
        self.n = 0
        self.cache_seen = None
        self.carried = set()  # aborted when not live: the scheduler may keep these pending
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
        h, tok = self.h, self.tok
        length = len(prompt)
        max_tokens = data.draw(st.integers(1, 30), label="max_tokens")
        min_tokens = data.draw(st.one_of(st.just(0), st.integers(0, max_tokens)), label="min_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        plain = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                 min_tokens=min_tokens, ignore_eos=ignore_eos)
        tokens, _, _, _ = oracle(self.runner, tok, prompt, plain, max_tokens)
        stop_ids = data.draw(st.one_of(st.just(()), st.tuples(st.sampled_from(tokens))), label="stop ids")
        text = tok.decode(tokens)
        stop = ()
        if text and data.draw(st.booleans(), label="stop string?"):
            at = data.draw(st.integers(0, len(text) - 1), label="stop at")
            stop = (text[at:at + data.draw(st.integers(1, 4), label="stop len")],)
        rid = self.fresh("q")
        if self.pre and data.draw(st.booleans(), label="pre-aborted id"):
            rid = self.pre.pop(0)
        params = dict(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                      stop=stop, stop_token_ids=stop_ids)
        limit = h.s.config.max_model_len
        refused = (length >= limit or h.s.blocks_for(length + 1) > h.pool.num_blocks
                   or max_tokens > limit - length)
        try:
            h.submit(prompt, request_id=rid, **params)
        except EngineError as e:
            assert refused, f"refused a request that fits: {e}"
            if rid.startswith("pre"):
                self.pre.append(rid)
            return
        assert not refused, (length, max_tokens, limit, h.pool.num_blocks)
        gp = GenerationParams(SamplingParams(temperature=0.0), **params)
        self.subs[rid] = (prompt, gp, max_tokens, oracle(self.runner, tok, prompt, gp, max_tokens))
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
        self.h.s.abort(rid)
        self.pre.append(rid)
        self.aborted.add(rid)

    @rule(data=st.data(), kind=st.sampled_from(
        ["waiting", "prefilling", "decoding", "preempted", "finished", "never-seen"]))
    @guarded
    def abort(self, data, kind):
        s = self.h.s
        where = {"waiting": s.waiting, "prefilling": s.prefilling, "decoding": s.decoding,
                 "preempted": s.preempted}
        if kind in where:
            candidates = sorted(r.id for r in where[kind])
        elif kind == "finished":
            candidates = sorted(self.done)
        else:
            candidates = []
        rid = data.draw(st.sampled_from(candidates), label="abort") if candidates else self.fresh("ghost")
        if rid in s.requests:
            self.must_cancel.add(rid)
            self.aborted.add(rid)
        else:
            self.carried.add(rid)  # never seen, or already gone: the scheduler cannot tell
        s.abort(rid)

    @rule(row=st.integers(0, 7))
    @guarded
    def abort_during_step(self, row):
        """An abort that arrives while the forward pass runs (a client leaving mid-step): the
        request may finish in that very step, or is cancelled at the next step boundary."""

        def during(plan):
            rid = plan.rows[row % len(plan.rows)].request_id
            self.h.s.abort(rid)
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
            if not self.h.s.has_work and self.h.running is None:
                break
            self.tick_and_check()
        else:
            raise AssertionError("the scheduler did not go idle")
        s, pool = self.h.s, self.h.pool
        assert pool.used == 0 and pool.available == pool.num_blocks, pool.used
        assert s.swap_used == 0, s.swap_used
        assert not (s.waiting or s.prefilling or s.decoding or s.preempted or s.finished or s.in_flight)
        assert self.done == set(self.subs), set(self.subs) - self.done
        assert self.pre_submitted <= self.done
        # an abort stays pending only for an id the scheduler has not seen live: not for one that
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
        """Every block the prefix cache can hand out holds the K/V of the prefix that finds it: walk
        all findable chains, built from the tokens the cached blocks hold."""
        pool, runner = self.h.pool, self.runner
        if not pool.prefix_caching:
            return
        bs = pool.block_size
        cached = sorted(pool.key_of)
        slots = [b * bs + i for b in cached for i in range(bs)]
        seen = (repr(pool.key_of), repr(pool.block_of), runner.kv[slots].tobytes(),
                runner.ctx[slots].tobytes())
        if seen == self.cache_seen:  # nothing changed since the last walk
            return
        self.cache_seen = seen
        contents = {tuple(int(t) for t in runner.kv[b * bs:(b + 1) * bs]) for b in cached}
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
                    slot = runner.slot(hits, p)
                    assert runner.kv[slot] == tokens[p] and runner.ctx[slot] == h, \
                        f"the prefix cache hands out block {hits[-1]} after {prefix}, but its K/V" \
                        f" was computed under another prefix"
                if len(hits) < pool.num_blocks:
                    frontier.append((tokens, h))

    def tick_and_check(self):
        runner = self.runner
        steps = runner.steps
        self.h.tick()  # Harness.check: blocks held == blocks used, one place each, <= max_seqs,
        # at most one final frame and it is the last
        failed = runner.steps > steps and runner.steps in runner.fail_steps
        if failed:
            self.failed.update(runner.rows_seen[-1])
        self.check_prefix_cache()
        s = self.h.s
        for rid, (prompt, params, max_tokens, (want, want_text, reason, stop_reason)) in self.subs.items():
            if rid in self.done:
                continue
            frames = self.h.frames[rid]
            tokens, text = self.h.tokens(rid), self.h.text(rid)
            assert tokens == want[:len(tokens)], f"{rid}: sent {tokens}, expected a prefix of {want}"
            assert want_text.startswith(text), f"{rid}: sent {text!r}, expected a prefix of {want_text!r}"
            finals = [f for f in frames if f.finish_reason is not None]
            live = rid in s.requests
            assert live != bool(finals), f"{rid}: live={live} with {len(finals)} final frames"
            if not finals:
                assert rid not in self.must_cancel, f"{rid}: aborted, still live a tick later"
                continue
            self.done.add(rid)
            f = finals[0]
            assert f.finish_reason in REASONS, f.finish_reason
            assert f.usage.prompt_tokens == len(prompt) and f.usage.completion_tokens == len(tokens)
            assert 0 <= f.usage.cached_tokens < len(prompt)
            if rid in self.must_cancel or rid in self.pre_submitted:
                assert f.finish_reason == "cancelled", f"{rid}: aborted, ended {f.finish_reason}"
            if rid in self.pre_submitted:
                assert tokens == [] and text == "", rid
            if f.finish_reason in ("stop", "length"):
                got = (tokens, text, f.finish_reason, f.stop_reason)
                assert got == (want, want_text, reason, stop_reason), \
                    f"{rid}: ended {f.finish_reason} {f.stop_reason!r} with {tokens} {text!r}; expected" \
                    f" {reason} {stop_reason!r} with {want} {want_text!r}"
            elif f.finish_reason == "cancelled":
                assert rid in self.aborted, f"{rid}: cancelled, never aborted"
            else:
                if rid in self.failed:
                    assert f.error == INJECTED, f.error
                else:  # the only other error: it outgrew the whole pool, one token past its capacity
                    assert "KV cache" in f.error, f.error
                    assert len(prompt) + len(tokens) == self.cap + 1, \
                        f"{rid}: KV error at {len(prompt)}+{len(tokens)} tokens; the pool holds {self.cap}"
            if failed and rid in runner.rows_seen[-1]:
                assert f.finish_reason == "error", f"{rid}: in a failed step, ended {f.finish_reason}"
        if failed:
            for rid in runner.rows_seen[-1]:
                assert rid in self.done, f"{rid}: in a failed step, still live"
        self.must_cancel -= self.done
        assert not self.must_cancel, f"aborted, still live a tick later: {self.must_cancel}"
        self.must_cancel, self.step_aborted = self.step_aborted - self.done, set()


def test_scheduler_under_random_interleavings(tiny_dir):
    tok = Tokenizer(tiny_dir)
    run_state_machine_as_test(lambda: SchedulerMachine(tok), settings=SETTINGS)
