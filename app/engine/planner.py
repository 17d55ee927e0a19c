"""Which requests run in the next step, on which KV blocks: admission, resume, plan, preemption.
It sees token ids and blocks only; what a token means, and every call into the runner, are not here.

Per tick the engine calls `start_tick()` (aborts, retire, resume) and carries out its reloads,
then `schedule()` (admit, plan) and carries out its spills before it launches the step; then
`landed()` or `fail()`, then `retire()`. Every end goes through `finish()` and leaves through
`retire()`, the one path that frees blocks. A failed reload re-prefills, a failed spill recomputes.

The overlapped loop (a GPU runner) plans step N+1 while step N still runs, before N's tokens
are applied. What such a plan sees one step late, and how it stays right:
- A decoding request with a row in step N is fed the token N is sampling as AHEAD (the runner
  takes it from the device) at the position after it; when that token turns out to be a stop,
  the row's result is dropped when it lands, and nothing past the stop is ever sent. A request
  whose token in N is its max_tokens-th, or whose next row needs a mask (a grammar, a thinking
  budget: they depend on that token), sits this step out.
- A prefill chunk continues after the one in flight; a request whose last chunk is in flight
  decodes from the step after.
- Aborts, admissions and resumes happen at step boundaries as before; blocks freed while a step
  runs go to later steps, which the device runs after it.
- Preemption never happens while a step runs: when a row cannot get a block without one, the
  Schedule's step is None, and the engine waits for the running step and plans again.

Where every layer slides (window: Mistral's, Phi-3's), a request's blocks wholly before the
window of its next query are freed as its steps land (drop_outside_window), so a long request
holds at most window / block_size + 1 blocks once its prompt is in; its rows' tables keep the
logical positions, the freed entries pointing at its first held block, which attention never
weighs (every key there is outside the window). A step in flight may still read a freed block;
a later step, which the device runs after it, is the first that can write it.
"""

import time
from collections import deque
from dataclasses import dataclass

from app.engine.block_pool import BlockPool
from app.engine.request import Request, State
from app.engine.schedule import Reload, Schedule, Spill, TickStart
from app.engine.speculation import SpeculativeConfig, Speculation
from app.engine.stats import Stats
from model.runner import AHEAD, Row, StepPlan


@dataclass
class PlannerConfig:
    max_model_len: int
    max_seqs: int = 64
    max_batched_tokens: int = 1024  # per step: decode rows plus prefill tokens
    prefill_chunk: int = 256
    swap_blocks: int = 0  # host spill pool, in blocks; 0 means preempt by recompute
    immunity_tokens: int = 16  # a resumed request is not preempted again for this many tokens
    speculative: SpeculativeConfig | None = None  # decode rows carry guesses to verify (speculation.py)

    def __post_init__(self):
        if self.max_batched_tokens < self.max_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be at least max_seqs"
                             f" ({self.max_seqs}): every running request decodes one token a step")


@dataclass
class Admitted:
    """What ticks admitted since the last Prefill status line, counted at admission."""

    seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0


class Planner:
    def __init__(self, config: PlannerConfig, pool: BlockPool, rows, stats: Stats, window: int = 0):
        self.config = config
        self.pool = pool
        # the positions back every layer attends to; blocks freed behind it (0: never). A window
        # of a block or less is not freed behind: the prefix cache names a block by its parent.
        self.window = window if window > pool.block_size else 0
        self.rows = rows  # OutputProcessor: needs_mask, sampling_params and mask of a request's row
        self.stats = stats  # the planner counts prompt tokens, prefix-cache hits and preemptions
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.preempted: list[Request] = []
        self.finished: list[Request] = []
        self.aborts: set[str] = set()  # pending, including ids not seen yet (carried)
        self.swap_used = 0
        self.in_flight: list[StepPlan] = []  # planned and not yet landed (or failed), oldest first
        self.speculation = Speculation(config.speculative) if config.speculative else None
        self.admitted = Admitted()
        self.reloads: list[Reload] = []  # decided by this tick's resume
        self.spills: list[Spill] = []  # decided by this tick's plan
        self._seq = 0

    def add(self, request: Request) -> None:
        self._seq += 1
        request.seq = self._seq
        self.requests[request.id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # -- the tick -------------------------------------------------------------------------------

    def start_tick(self) -> TickStart:
        self.apply_aborts()
        retired = self.retire()
        self.reloads = []
        self.resume()
        return TickStart(retired, self.reloads)

    def schedule(self) -> Schedule:
        self.spills = []
        self.admit()
        flying = {r.request_id: r for r in self.in_flight[-1].rows} if self.in_flight else {}
        decode_rows = self.plan_decode(flying)
        step = None
        if decode_rows is not None:
            decode_tokens = sum(len(row.token_ids) for row in decode_rows)
            step = StepPlan(decode_rows + self.plan_prefill(decode_tokens, flying))
            if step.rows:
                self.in_flight.append(step)
        return Schedule(step, self.spills)

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
        """Mark a request done. It leaves, and frees its blocks, in retire()."""
        {State.WAITING: self.waiting, State.PREFILLING: self.prefilling,
         State.DECODING: self.decoding, State.PREEMPTED: self.preempted}[request.state].remove(request)
        request.state = State.FINISHED
        request.finish_reason, request.stop_reason, request.error = reason, stop_reason, error
        self.finished.append(request)

    def retire(self) -> list[Request]:
        """The finished requests, gone from the planner with their blocks freed; a host copy
        (request.spilled) is left for the engine to drop."""
        retired, self.finished = self.finished, []
        for request in retired:
            self.pool.release(request.block_table)
            request.block_table = []
            self.swap_used -= request.spill_blocks
            request.spill_blocks = 0
            del self.requests[request.id]
            self.aborts.discard(request.id)  # one that came in while it finished has nothing to end
            if self.speculation:
                self.speculation.release(request.id)
        return retired

    # -- resume and admission ---------------------------------------------------------------------

    def resume(self) -> None:
        """Preempted requests come back first, fewest blocks first, with a block of headroom."""
        for request in sorted(self.preempted, key=lambda r: r.num_tokens):
            needed = self.pool.blocks_for(request.num_tokens)  # its next step feeds position num_tokens - 1
            if needed > self.pool.num_blocks:
                self.finish(request, "error", error=f"the request grew to {request.num_tokens} tokens, more"
                            f" than the whole KV cache holds ({self.pool.num_blocks} blocks)")
                continue
            headroom = min(needed + 1, self.pool.num_blocks)
            if self.num_running >= self.config.max_seqs or headroom > self.pool.available:
                break
            if request.spilled is not None:
                self.reload(request)
            elif not self.start_prefill(request, request.all_ids, request.target):
                break
            self.preempted.remove(request)
            request.immune_until = len(request.output_ids) + self.config.immunity_tokens

    def reload(self, request: Request) -> None:
        """Its host copy goes back into fresh blocks (the engine copies it before the step)."""
        request.block_table = self.pool.allocate_many(request.spill_blocks)
        self.reloads.append(Reload(request, request.block_table, request.spilled))
        self.swap_used -= request.spill_blocks
        request.spilled, request.spill_blocks = None, 0
        request.state = State.DECODING
        self.decoding.append(request)

    def start_prefill(self, request: Request, tokens: list[int], target: int) -> bool:
        """Take cached prefix blocks and allocate the rest for target tokens; False (and
        nothing held) when the pool cannot hold them."""
        scores = request.params.prompt_logprobs is not None and request.state is State.WAITING
        hits = [] if scores else self.pool.match_prefix(tokens)  # a scored position must be computed
        fresh = self.pool.allocate_many(self.pool.blocks_for(target) - len(hits))
        if fresh is None:
            self.pool.release(hits)
            return False
        request.block_table, request.dropped_blocks = hits + fresh, 0
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
        while self.waiting and not self.preempted:
            if self.num_running >= self.config.max_seqs or self.prefill_budget(len(self.decoding)) <= 0:
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

    # -- planning and preemption --------------------------------------------------------------------

    def plan_decode(self, flying: dict) -> list[Row] | None:
        """flying: the rows of the step in flight, by request id. None when a row needs a block
        that only preemption could free while that step runs."""
        planned = []
        for request in sorted(self.decoding, key=lambda r: r.seq):
            if request.state is not State.DECODING:
                continue  # preempted by an older row of this same step
            ahead = request.id in flying
            if ahead and (len(request.output_ids) + 1 >= request.max_tokens or self.rows.needs_mask(request)):
                continue  # its next row depends on the token in flight
            position = request.num_tokens - 1 + ahead
            while request.dropped_blocks + len(request.block_table) <= position // self.pool.block_size:
                block = self.pool.allocate()
                if block is not None:
                    request.block_table.append(block)
                    continue
                if flying:
                    return None
                if not self.make_room(request):
                    break
            if request.state is State.DECODING:
                planned.append((request, ahead))
        rows = [self.decode_row(r, ahead) for r, ahead in planned if r.state is State.DECODING]
        return self.add_guesses(rows) if self.speculation else rows

    def add_guesses(self, rows: list[Row]) -> list[Row]:
        """Each decode row may carry guesses: prompt lookup's, made here, or room for a draft
        model's, which the runner makes (Row.draft_limit). They take blocks free now (a guess
        never preempts) within the step's token budget. A grammar's row guesses by lookup only,
        with a mask for each position. Not for a row fed ahead, one under a thinking budget or
        penalties, or one whose stop tokens min_tokens still bans."""
        spare = self.config.max_batched_tokens - len(rows)
        lookup = self.speculation.lookup
        for row in rows:
            request = self.requests[row.request_id]
            p = request.params
            masked = row.mask is not None
            if (spare <= 0 or row.token_ids[0] == AHEAD or p.sampling.penalized or len(request.output_ids) < p.min_tokens
                    or masked and not (lookup and self.rows.guessable(request))):
                continue
            count = self.speculation.allowance(request, min(spare, request.max_tokens - len(request.output_ids) - 1))
            guesses = lookup.propose(request.all_ids, count) if lookup and count else []
            count = len(guesses) if lookup else count
            while count and request.dropped_blocks + len(request.block_table) <= \
                    (request.num_tokens - 1 + count) // self.pool.block_size:  # the last guess's position
                block = self.pool.allocate()
                if block is None:
                    count = (request.dropped_blocks + len(request.block_table)) * self.pool.block_size \
                        - request.num_tokens
                    break
                request.block_table.append(block)
            if count:
                if lookup:
                    row.token_ids, row.num_draft = [row.token_ids[0], *guesses[:count]], count
                    if masked:  # the plain mask is not needed: the first of the new ones is it
                        row.mask.cancel()
                        row.mask = self.rows.guess_masks(request, guesses[:count])
                else:
                    row.draft_limit = count
                row.block_table = self.table(request)
                spare -= count
        return rows

    def make_room(self, needy: Request) -> bool:
        """Preempt one victim, newest first, never an immune one (unless only the needy one is
        left). Returns False when the needy request itself had to go."""
        if self.pool.blocks_for(needy.num_tokens) > self.pool.num_blocks:
            self.finish(needy, "error", error=f"the request grew to {needy.num_tokens} tokens, more than"
                        f" the whole KV cache holds ({self.pool.num_blocks} blocks)")
            return False
        candidates = [r for r in self.decoding if len(r.output_ids) >= r.immune_until]
        victim = max(candidates, key=lambda r: r.seq) if candidates else needy
        self.preempt(victim)
        return victim is not needy

    def preempt(self, request: Request) -> None:
        """Spilled when the host pool has room (the engine copies the blocks out before the
        step that may reuse them), else recomputed from its token history."""
        self.decoding.remove(request)
        request.state = State.PREEMPTED
        self.stats.preemptions += 1
        self.offer_full_blocks(request)
        spill_blocks = len(request.block_table)
        if self.swap_used + spill_blocks <= self.config.swap_blocks:
            self.spills.append(Spill(request, request.block_table))
            request.spill_blocks = spill_blocks
            self.swap_used += spill_blocks
        else:
            request.num_computed = request.num_offered = 0
        self.pool.release(request.block_table)
        request.block_table = []
        self.preempted.append(request)

    def offer_full_blocks(self, request: Request) -> None:
        """Blocks filled since the last offer go to the prefix cache (skipped when none did:
        building the token history for every row of every step is not free)."""
        if request.num_computed - request.num_offered >= self.pool.block_size:
            request.num_offered = self.pool.cache_full_blocks(
                self.table(request), request.all_ids, request.num_offered, request.num_computed)

    def table(self, request: Request) -> list[int]:
        """The request's block table by logical block: its freed leading entries pointing at its
        first held block (a fresh list then, so a planned row keeps its own)."""
        if not request.dropped_blocks:
            return request.block_table
        return [request.block_table[0]] * request.dropped_blocks + request.block_table

    def drop_outside_window(self, request: Request) -> None:
        """Free the leading blocks no later query sees: every position in them is at least
        window before the next one computed (after their offer to the prefix cache)."""
        drop = (request.num_computed - self.window + 1) // self.pool.block_size - request.dropped_blocks
        drop = min(drop, len(request.block_table) - 1)  # the table keeps a block to point at
        if self.window and drop > 0:
            self.pool.release(request.block_table[:drop])
            request.block_table = request.block_table[drop:]
            request.dropped_blocks += drop

    def decode_row(self, request: Request, ahead: bool) -> Row:
        """ahead: fed the token the step in flight samples, at the position after it."""
        last = AHEAD if ahead else request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
        return Row(request.id, [last], request.num_tokens - 1 + ahead, self.table(request), sample=True,
                   params=self.rows.sampling_params(request, ahead), prompt_ids=request.prompt_ids,
                   output_ids=request.output_ids, mask=self.rows.mask(request))

    def plan_prefill(self, decode_rows: int, flying: dict) -> list[Row]:
        """Up to prefill_chunk tokens, round-robin: each prefilling request in turn gets a chunk,
        and the ones served go to the back of the line for the next step. A chunk in flight
        counts as computed."""
        budget = self.prefill_budget(decode_rows)
        rows, served = [], []
        for request in list(self.prefilling):
            if budget <= 0:
                break
            chunk = flying.get(request.id)
            start = request.num_computed + (len(chunk.token_ids) if chunk is not None else 0)
            n = min(request.target - start, budget)
            if n <= 0:
                continue  # its last chunk is in flight
            budget -= n
            end = start + n
            tokens = request.all_ids[start:end]
            last = end == request.target and not request.output_ids
            sample = last and not request.params.embed and request.max_tokens > 0
            rows.append(Row(request.id, tokens, start, self.table(request), sample=sample,
                            params=self.rows.sampling_params(request), prompt_ids=request.prompt_ids,
                            output_ids=request.output_ids, mask=self.rows.mask(request) if sample else None,
                            embed=last and request.params.embed,
                            prompt_logprobs=None if request.output_ids else request.params.prompt_logprobs))
            served.append(request)
        for request in served:
            self.prefilling.remove(request)
            self.prefilling.append(request)
        return rows

    # -- what the engine reports back ---------------------------------------------------------------

    def spill_saved(self, spill: Spill, host_copy) -> None:
        spill.request.spilled = host_copy

    def spill_failed(self, spill: Spill) -> None:
        """No host copy: the request recomputes its K/V when it resumes."""
        request = spill.request
        self.swap_used -= request.spill_blocks
        request.spill_blocks = 0
        request.num_computed = request.num_offered = 0

    def reload_failed(self, reload: Reload) -> None:
        """The host copy did not come back: the request re-prefills its history instead, or
        waits among the preempted when the pool cannot hold it now."""
        request = reload.request
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_computed = request.num_offered = 0
        self.decoding.remove(request)
        request.state = State.PREEMPTED
        if not self.start_prefill(request, request.all_ids, request.target):
            self.preempted.append(request)

    def landed(self, plan: StepPlan) -> list[tuple[Request, Row]]:
        """A step's rows are computed: their K/V counts, full blocks go to the prefix cache, and
        a finished prefill decodes (or ends: max_tokens 0). Returns the requests of its rows with
        a result (sampled, embedded, or prompt logprobs); a request that ended while the step ran
        (the overlapped loop) has its row's result dropped."""
        self.in_flight = [p for p in self.in_flight if p is not plan]
        sampling = []
        for row in plan.rows:
            request = self.requests.get(row.request_id)
            if request is None or request.state is State.FINISHED:
                continue
            request.num_computed += len(row.token_ids) - row.num_draft  # guesses count once verified
            self.offer_full_blocks(request)
            self.drop_outside_window(request)
            if request.state is State.PREFILLING and request.num_computed == request.target:
                self.prefilling.remove(request)
                request.state = State.DECODING
                self.decoding.append(request)
                if request.max_tokens == 0:  # its prompt was all it asked to read
                    self.finish(request, "length")
            if row.sample or row.embed or row.prompt_logprobs is not None:
                sampling.append((request, row))
        return sampling

    def verified(self, request: Request, row: Row, kept: int, appended: int) -> None:
        """A row with guesses landed: `kept` of them matched what the model sampled, and
        `appended` tokens joined the output (fewer when one ended the request). The K/V of the
        guesses among those counts; the blocks past the next row's position go back, so the
        rejected guesses' K/V is never offered to the prefix cache and is written over."""
        self.speculation.verified(request, row.num_draft, kept)
        if request.state is State.FINISHED:
            return
        request.num_computed += appended - 1
        self.offer_full_blocks(request)
        self.drop_outside_window(request)
        keep = self.pool.blocks_for(request.num_tokens) - request.dropped_blocks
        if len(request.block_table) > keep:
            self.pool.release(request.block_table[keep:])
            del request.block_table[keep:]

    def fail(self, plan: StepPlan, message: str) -> None:
        """The runner raised: every row of that step ends with an error (once its mask, if it
        has one, is done with its matcher)."""
        self.in_flight = [p for p in self.in_flight if p is not plan]
        for row in plan.rows:
            if row.mask is not None:
                row.mask.exception()  # waits; the mask's own error, if any, is the step's
            request = self.requests.get(row.request_id)
            if request is not None and request.state is not State.FINISHED:
                self.finish(request, "error", error=message)
