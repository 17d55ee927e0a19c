"""The synchronous heart of the engine: admission, step planning, preemption, stops, flush.

No Trio and no arrays here. The Engine calls, once per tick: `schedule()` (apply aborts,
flush, resume, admit, plan), then the runner, then `apply()` or `fail()`, then `flush()`.
Every early end goes through `finish()` and leaves through `flush()`, the one path that frees
blocks and sends the final frame.

The overlapped loop (a GPU runner) plans step N+1 while step N still runs, before N's tokens
are applied. What such a plan sees one step late, and how it stays right:
- A decoding request with a row in step N is fed the token N is sampling as AHEAD (the runner
  takes it from the device) at the position after it; when that token turns out to be a stop,
  the row's result is dropped at apply, and nothing past the stop is ever sent. A request whose
  token in N is its max_tokens-th, or whose next row needs a mask (a grammar, a thinking
  budget: they depend on that token), sits this step out.
- A prefill chunk continues after the one in flight; a request whose last chunk is in flight
  decodes from the step after.
- Aborts, admissions and resumes happen at step boundaries as before; blocks freed while a step
  runs go to later steps, which the device runs after it.
- Preemption never happens while a step runs: when a row cannot get a block without one,
  schedule() returns None, and the engine waits for the running step and plans again.
"""

import time
from collections import Counter, deque
from dataclasses import dataclass, replace

from app.engine.block_pool import BlockPool
from app.engine.grammar import Grammars
from app.engine.request import Frame, GenerationParams, Request, State
from app.engine.stats import Stats
from app.engine.stops import StopMatcher
from model.errors import one_line
from model.runner import AHEAD, Row, Sampled, StepPlan
from model.tokenizer import IncrementalDetokenizer

BAN = float("-inf")  # how min_tokens holds back the stops: they cannot be sampled at all


class EngineError(ValueError):
    """A request the engine refuses; the message is fit for an API client, and param names the
    request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Overloaded(EngineError):
    """The waiting queue is full; try again later (HTTP 429)."""


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_seqs: int = 64
    max_batched_tokens: int = 1024  # per step: decode rows plus prefill tokens
    prefill_chunk: int = 256
    max_queue: int = 1024
    swap_blocks: int = 0  # host spill pool, in blocks; 0 means preempt by recompute
    immunity_tokens: int = 16  # a resumed request is not preempted again for this many tokens

    def __post_init__(self):
        if self.max_batched_tokens < self.max_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be at least max_seqs"
                             f" ({self.max_seqs}): every running request decodes one token a step")


@dataclass
class Admitted:
    """What a tick admitted, counted at admission (for the Prefill status line)."""

    seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, runner, tokenizer):
        self.config = config
        self.pool = pool
        self.runner = runner  # only for save_blocks, load_blocks, drop_spill and release
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.preempted: list[Request] = []
        self.finished: list[Request] = []
        self.aborts: set[str] = set()  # pending, including ids not seen yet (carried)
        self.swap_used = 0
        self.in_flight: list[StepPlan] = []  # planned and not yet applied (or failed), oldest first
        self.stats = Stats()
        self.admitted = Admitted()
        self.grammars = Grammars(tokenizer)
        self._seq = 0

    # -- submission -------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def check(self, prompt_ids: list[int], params: GenerationParams) -> int:
        """Refuse what could never run; returns max_tokens resolved against the context."""
        limit = self.config.max_model_len
        if not prompt_ids:
            raise EngineError("the prompt is empty", "prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        if len(prompt_ids) >= limit:
            raise EngineError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit}", "prompt")
        if self.blocks_for(len(prompt_ids) + 1) > self.pool.num_blocks:
            raise EngineError(f"the prompt needs {self.blocks_for(len(prompt_ids) + 1)} KV blocks and the"
                              f" cache has {self.pool.num_blocks}; start the server with a larger KV cache", "prompt")
        room = limit - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > room:
            raise EngineError(f"max_tokens is {max_tokens}, but the context of {limit} leaves {room}"
                              f" after the {len(prompt_ids)}-token prompt", "max_tokens")
        if not 0 <= params.min_tokens <= max_tokens:
            raise EngineError(f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {params.min_tokens}",
                              "min_tokens")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"stop_token_ids has {bad}, outside the vocabulary [0, {vocab})", "stop_token_ids")
        try:
            params.sampling.validate(vocab)
        except ValueError as e:
            raise EngineError(str(e), str(e).split(" ", 1)[0]) from None
        if params.grammar is not None:
            try:
                self.grammars.pristine(params.grammar)
            except ValueError as e:
                raise EngineError(f"the output format cannot be compiled: {one_line(e)}", "grammar") from None
        return max_tokens

    def add(self, request: Request) -> None:
        self._seq += 1
        request.seq = self._seq
        request.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids)
        request.stops = StopMatcher(request.params.stop)
        if request.params.grammar is not None:
            request.matcher = self.grammars.matcher(request.params.grammar)
        self.requests[request.id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # -- the tick -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step. While another runs (the overlapped loop), None when this one could
        only be planned by preempting."""
        self.apply_aborts()
        self.flush()
        self.resume()
        self.admit()
        running = {r.request_id: r for r in self.in_flight[-1].rows} if self.in_flight else {}
        decode_rows = self.plan_decode(running)
        if decode_rows is None:
            return None
        plan = StepPlan(decode_rows + self.plan_prefill(len(decode_rows), running))
        if plan.rows:
            self.in_flight.append(plan)
        return plan

    def landed(self, plan: StepPlan) -> None:
        self.in_flight = [p for p in self.in_flight if p is not plan]

    def apply_aborts(self) -> None:
        """Cancel where each request lives; ids not seen yet stay pending."""
        for request_id in list(self.aborts):
            request = self.requests.get(request_id)
            if request is None:
                continue
            self.aborts.discard(request_id)
            if request.state is not State.FINISHED:
                self.finish(request, "cancelled")

    def finish(self, request: Request, reason: str, stop_reason=None, error: str | None = None) -> None:
        """Mark a request done. It leaves, frees its blocks and gets its final frame in flush()."""
        {State.WAITING: self.waiting, State.PREFILLING: self.prefilling,
         State.DECODING: self.decoding, State.PREEMPTED: self.preempted}[request.state].remove(request)
        if reason == "length" or (reason == "stop" and not isinstance(stop_reason, str)):
            # a natural end that no stop string made: release what was held back
            request.pending_text += request.stops.feed(request.detok.flush())[0] + request.stops.flush()
        request.state = State.FINISHED
        request.finish_reason, request.stop_reason, request.error = reason, stop_reason, error
        self.finished.append(request)

    def flush(self) -> None:
        now = time.monotonic()
        for request in self.finished:
            self.pool.release(request.block_table)
            request.block_table = []
            self.drop_spill(request)
            self.runner.release(request.id)
            del self.requests[request.id]
            self.aborts.discard(request.id)  # one that came in while it finished has nothing to end
            self.stats.request_done(request, now)
            self.send(request, final=True)
        self.finished.clear()

    def drop_spill(self, request: Request) -> None:
        if request.spilled is not None:
            self.runner.drop_spill(request.spilled)
            self.swap_used -= request.spill_blocks
            request.spilled, request.spill_blocks = None, 0

    def send(self, request: Request, final: bool = False) -> None:
        frame = Frame(request.id, request.pending_text, request.pending_ids,
                      request.pending_logprobs if request.params.sampling.logprobs is not None else None)
        if final:
            frame.finish_reason, frame.stop_reason = request.finish_reason, request.stop_reason
            frame.usage, frame.error = request.usage(), request.error
        request.pending_text, request.pending_ids, request.pending_logprobs = "", [], []
        try:
            request.emit(frame)
        except Exception:  # full or closed channel: the client cannot keep up or has left
            if not final:
                self.finish(request, "cancelled")

    # -- resume and admission -------------------------------------------------------------

    def resume(self) -> None:
        """Preempted requests come back first, fewest blocks first, with a block of headroom."""
        for request in sorted(self.preempted, key=lambda r: r.num_tokens):
            needed = self.blocks_for(request.num_tokens)  # its next step feeds position num_tokens - 1
            if needed > self.pool.num_blocks:
                self.finish(request, "error", error=f"the request grew to {request.num_tokens} tokens, more"
                            f" than the whole KV cache holds ({self.pool.num_blocks} blocks)")
                continue
            headroom = min(needed + 1, self.pool.num_blocks)
            if self.running >= self.config.max_seqs or headroom > self.pool.available:
                break
            if request.spilled is not None and self.reload(request):
                request.state = State.DECODING
                self.decoding.append(request)
            elif request.spilled is None and not self.start_prefill(request, request.all_ids, request.target):
                break
            self.preempted.remove(request)
            request.immune_until = len(request.output_ids) + self.config.immunity_tokens

    def reload(self, request: Request) -> bool:
        """Bring a spilled request's K/V back; when that fails, it is re-prefilled instead."""
        request.block_table = self.pool.allocate_many(request.spill_blocks)
        try:
            self.runner.load_blocks(request.block_table, request.spilled)
        except Exception:
            self.pool.release(request.block_table)
            request.block_table = []
            request.num_computed = request.num_offered = 0
        self.drop_spill(request)
        return bool(request.block_table)

    def start_prefill(self, request: Request, tokens: list[int], target: int) -> bool:
        """Take cached prefix blocks and allocate the rest for target tokens; False (and
        nothing held) when the pool cannot hold them."""
        hits = self.pool.match_prefix(tokens)
        fresh = self.pool.allocate_many(self.blocks_for(target) - len(hits))
        if fresh is None:
            self.pool.release(hits)
            return False
        request.block_table = hits + fresh
        request.num_computed = request.num_offered = len(hits) * self.pool.block_size
        if request.state is State.WAITING:
            request.cached_tokens = request.num_computed
        if request.num_computed == target:  # a recompute whose whole history was cached
            request.state = State.DECODING
            self.decoding.append(request)
        else:
            request.state = State.PREFILLING
            self.prefilling.append(request)
        return True

    def admit(self) -> None:
        """Strict FIFO: a head that does not fit stops the line. Preempted requests are older
        than anything waiting, so nothing is admitted while one waits to resume."""
        c = self.config
        while self.waiting and not self.preempted:
            if self.running >= c.max_seqs or self.prefill_budget(len(self.decoding)) <= 0:
                break
            request = self.waiting[0]
            if not self.start_prefill(request, request.prompt_ids, len(request.prompt_ids)):
                break
            self.waiting.popleft()
            request.scheduled_at = time.monotonic()
            prompt = len(request.prompt_ids)
            self.stats.prompt_tokens += prompt
            self.stats.prefix_cache_queries += prompt
            self.stats.prefix_cache_hits += request.cached_tokens
            self.admitted.seqs += 1
            self.admitted.new_tokens += prompt - request.cached_tokens
            self.admitted.cached_tokens += request.cached_tokens

    def prefill_budget(self, decode_rows: int) -> int:
        """Prefill tokens a step can carry beside its decode rows. Admission needs it to be
        positive; the admitted requests then share it round-robin."""
        return min(self.config.prefill_chunk, self.config.max_batched_tokens - decode_rows)

    # -- planning and preemption ------------------------------------------------------------

    def plan_decode(self, running: dict) -> list[Row] | None:
        """running: the rows of the step in flight, by request id. None when a row needs a block
        that only preemption could free while that step runs."""
        planned = []
        for request in sorted(self.decoding, key=lambda r: r.seq):
            if request.state is not State.DECODING:
                continue  # preempted by an older row of this same step
            ahead = request.id in running
            if ahead and (len(request.output_ids) + 1 >= request.max_tokens or self.needs_mask(request)):
                continue  # its next row depends on the token in flight
            position = request.num_tokens - 1 + ahead
            while len(request.block_table) <= position // self.pool.block_size:
                block = self.pool.allocate()
                if block is not None:
                    request.block_table.append(block)
                    continue
                if running:
                    return None
                if not self.make_room(request):
                    break
            if request.state is State.DECODING:
                planned.append((request, ahead))
        return [self.decode_row(r, ahead) for r, ahead in planned if r.state is State.DECODING]

    def make_room(self, needy: Request) -> bool:
        """Preempt one victim, newest first, never an immune one (unless only the needy one is
        left). Returns False when the needy request itself had to go."""
        if self.blocks_for(needy.num_tokens) > self.pool.num_blocks:
            self.finish(needy, "error", error=f"the request grew to {needy.num_tokens} tokens, more than"
                        f" the whole KV cache holds ({self.pool.num_blocks} blocks)")
            return False
        candidates = [r for r in self.decoding if len(r.output_ids) >= r.immune_until]
        victim = max(candidates, key=lambda r: r.seq) if candidates else needy
        self.preempt(victim)
        return victim is not needy

    def preempt(self, request: Request) -> None:
        self.decoding.remove(request)
        request.state = State.PREEMPTED
        self.stats.preemptions += 1
        self.offer_full_blocks(request)
        spill_blocks = len(request.block_table)
        if self.swap_used + spill_blocks <= self.config.swap_blocks:
            try:
                request.spilled = self.runner.save_blocks(request.block_table)
                request.spill_blocks = spill_blocks
                self.swap_used += spill_blocks
            except Exception:  # a failed spill falls back to recompute
                request.spilled = None
        self.pool.release(request.block_table)
        request.block_table = []
        if request.spilled is None:
            request.num_computed = request.num_offered = 0
        self.preempted.append(request)

    def sampling_params(self, request: Request, ahead: bool = False):
        """min_tokens: until it is reached, the stop tokens are banned outright."""
        p = request.params
        sampling = p.sampling
        if len(request.output_ids) + ahead < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
            if banned:
                sampling = replace(sampling, logit_bias={**sampling.logit_bias, **{t: BAN for t in banned}})
        return sampling

    def offer_full_blocks(self, request: Request) -> None:
        """Blocks filled since the last offer go to the prefix cache (skipped when none did:
        building the token history for every row of every step is not free)."""
        if request.num_computed - request.num_offered >= self.pool.block_size:
            request.num_offered = self.pool.cache_full_blocks(
                request.block_table, request.all_ids, request.num_offered, request.num_computed)

    def decode_row(self, request: Request, ahead: bool) -> Row:
        """ahead: fed the token the step in flight samples, at the position after it."""
        last = AHEAD if ahead else request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
        return Row(request.id, [last], request.num_tokens - 1 + ahead, request.block_table, sample=True,
                   params=self.sampling_params(request, ahead), prompt_ids=request.prompt_ids,
                   output_ids=request.output_ids, mask=self.mask(request))

    @staticmethod
    def needs_mask(request: Request) -> bool:
        return request.matcher is not None or request.params.thinking is not None

    def mask(self, request: Request):
        """None when nothing constrains the request; else a Future of its mask, computed on the
        grammars' thread while the step's forward pass runs (the runner waits for it only to
        sample). Its matcher is the thread's until then: apply() and fail() come after."""
        if not self.needs_mask(request):
            return None
        return self.grammars.later(self.mask_now, request)

    def mask_now(self, request: Request):
        """The tokens allowed next: one, when a thinking budget is spent; else what its grammar
        allows; None when nothing constrains it."""
        forced = self.thinking_end(request)
        if forced is not None:
            return self.grammars.only(forced)
        return None if request.matcher is None else self.grammars.mask(request.matcher)

    def thinking_end(self, request: Request) -> int | None:
        """The next token of the thinking's end tags, once the budget is spent and until they are written."""
        budget, out = request.params.thinking, request.output_ids
        if budget is None or request.thought:
            return None
        end = budget.end_ids
        if budget.start_id is not None and (not out or out[0] != budget.start_id):
            request.thought = bool(out)  # the model answered without thinking
            return None
        if len(out) >= len(end) and tuple(out[-len(end):]) == end:
            request.thought = True
            return None
        if len(out) - (budget.start_id is not None) < budget.max_tokens:
            return None
        written = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or tuple(out[-k:]) == end[:k])
        return end[written]

    def plan_prefill(self, decode_rows: int, running: dict) -> list[Row]:
        """Up to prefill_chunk tokens, round-robin: each prefilling request in turn gets a chunk,
        and the ones served go to the back of the line for the next step. A chunk in flight
        counts as computed."""
        budget = self.prefill_budget(decode_rows)
        rows, served = [], []
        for request in list(self.prefilling):
            if budget <= 0:
                break
            flying = running.get(request.id)
            start = request.num_computed + (len(flying.token_ids) if flying is not None else 0)
            n = min(request.target - start, budget)
            if n <= 0:
                continue  # its last chunk is in flight
            budget -= n
            end = start + n
            tokens = request.all_ids[start:end]
            sample = end == request.target and not request.output_ids
            rows.append(Row(request.id, tokens, start, request.block_table, sample=sample,
                            params=self.sampling_params(request), prompt_ids=request.prompt_ids,
                            output_ids=request.output_ids, mask=self.mask(request) if sample else None))
            served.append(request)
        for request in served:
            self.prefilling.remove(request)
            self.prefilling.append(request)
        return rows

    # -- results --------------------------------------------------------------------------

    def apply(self, plan: StepPlan, sampled: list[Sampled]) -> None:
        self.landed(plan)
        by_id = {s.request_id: s for s in sampled}
        now = time.monotonic()
        for row in plan.rows:
            request = self.requests.get(row.request_id)
            if request is None or request.state is State.FINISHED:
                continue  # it ended while the step ran (the overlapped loop): the row's result is dropped
            request.num_computed += len(row.token_ids)
            self.offer_full_blocks(request)
            if request.state is State.PREFILLING and request.num_computed == request.target:
                self.prefilling.remove(request)
                request.state = State.DECODING
                self.decoding.append(request)
            if row.sample:
                self.accept(request, by_id[row.request_id], now)
        for request in list(self.decoding):
            if request.pending_ids or request.pending_text:
                self.send(request)

    def accept(self, request: Request, sampled: Sampled, now: float) -> None:
        """One new token: the stop checks, the detokenizer, and the stop-string buffer."""
        p = request.params
        token = sampled.token_id
        if request.matcher is not None and not request.matcher.consume_token(token):
            return self.finish(request, "error", error=f"the grammar refused token {token}: "
                                                       f"{request.matcher.get_error()}")
        request.output_ids.append(token)
        request.pending_ids.append(token)
        if p.sampling.logprobs is not None:
            request.pending_logprobs.append((token, sampled.logprob, sampled.top_logprobs))
        self.stats.token(request, now)
        request.first_token_at = request.first_token_at or now
        request.last_token_at = now
        may_stop = len(request.output_ids) > p.min_tokens
        if may_stop and token in self.eos_ids and not p.ignore_eos:
            return self.finish(request, "stop")
        if may_stop and token in p.stop_token_ids:
            return self.finish(request, "stop", stop_reason=token)
        text = request.detok.add(token)
        stop = None
        if may_stop:
            text, stop = request.stops.feed(text)
        request.pending_text += text
        if stop is not None:
            return self.finish(request, "stop", stop_reason=stop)
        if request.matcher is not None and request.matcher.is_stopped():  # the grammar is complete
            return self.finish(request, "stop")
        if len(request.output_ids) >= request.max_tokens:
            self.finish(request, "length")

    def fail(self, plan: StepPlan, message: str) -> None:
        """The runner raised: every row of that step ends with an error frame (once its mask,
        if it has one, is done with its matcher)."""
        self.landed(plan)
        for row in plan.rows:
            if row.mask is not None:
                row.mask.exception()  # waits; the mask's own error, if any, is the step's
            request = self.requests.get(row.request_id)
            if request is not None and request.state is not State.FINISHED:
                self.finish(request, "error", error=message)

    # -- introspection ----------------------------------------------------------------------

    def held_blocks(self) -> Counter:
        held = Counter()
        for request in self.requests.values():
            held.update(request.block_table)
        return held
