"""Which requests run in the next step, on which KV blocks: admission, resume, plan, preemption.
It plans rows from token ids and blocks only: what a token means (a row's sampling params and
mask) is the output processor's, added by the engine; every call into the runner is the engine's.

Per tick the engine calls `start_tick()` (aborts, retire, resume) and carries out its moves,
then `schedule()` (admit, plan) and carries out its moves before it launches the step; then
`landed()` or `fail()`, then `retire()`. Every end goes through `finish()` and leaves through
`retire()`, the one path that frees blocks. Where requests are is Queues'; their blocks,
BlockTables'; preemption and resume, Preemption's; the prefix cache's host tier, HostTier's;
guesses, Speculation's. Moves (block copies between the device and the host: Spill, Reload and
the host tier's) go on one list in the order they were decided, and are carried out in it.

The overlapped loop (a GPU runner) plans step N+1 while step N still runs, before N's tokens
are applied. What such a plan sees one step late, and how it stays right:
- A decoding request with a row in step N is fed the token N is sampling as AHEAD (the runner
  takes it from the device) at the position after it; when that token turns out to be a stop,
  the row's result is dropped when it lands, and nothing past the stop is ever sent. A request
  whose token in N is its max_tokens-th, or whose rows are masked (a grammar, a thinking
  budget: the mask depends on that token) or read the output (bad words...), sits this step out.
- A prefill chunk continues after the one in flight; a request whose last chunk is in flight
  decodes from the step after.
- Aborts, admissions and resumes happen at step boundaries as before; blocks freed while a step
  runs go to later steps, which the device runs after it.
- Preemption never happens while a step runs: when a row cannot get a block without one, the
  Schedule's step is None, and the engine waits for the running step and plans again.
"""

import time
from dataclasses import dataclass

from app.engine.block_pool import BlockPool
from app.engine.block_tables import BlockTables
from app.engine.host_tier import HostLoad, HostSave, HostTier
from app.engine.preemption import Preemption
from app.engine.queues import Queues
from app.engine.request import Request, State
from app.engine.schedule import Admitted, PlannerView, Reload, Schedule, Spill, TickStart
from app.engine.speculation import SpeculativeConfig, Speculation
from app.engine.state_slots import StateSlots
from app.engine.stats import Stats
from model.runner import AHEAD, Row, StepPlan


MIN_CHUNK = 16  # prompt tokens: a chunk shrunk by its attention keeps at least this many (one AMX tile)


@dataclass
class PlannerConfig:
    max_model_len: int
    max_seqs: int = 64
    max_batched_tokens: int = 1024  # per step: decode rows plus prefill tokens
    prefill_chunk: int = 256
    prefill_beside_decode: int = 0  # beside decode rows, in tokens at a prompt's start; 0: prefill_chunk
    swap_blocks: int = 0  # host spill pool, in blocks; 0 means preempt by recompute
    immunity_tokens: int = 16  # a resumed request is not preempted again for this many tokens
    speculative: SpeculativeConfig | None = None  # decode rows carry guesses to verify (speculation.py)
    state_slots: int = 0  # a hybrid model's requests that may hold delta-net state at once; 0: not hybrid

    def __post_init__(self):
        if self.max_batched_tokens < self.max_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be at least max_seqs"
                             f" ({self.max_seqs}): every running request decodes one token a step")


class Planner:
    def __init__(self, config: PlannerConfig, pool: BlockPool, stats: Stats, window: int = 0,
                 break_even: float = 0.0):
        self.config = config
        self.break_even = break_even  # the model's: where a prompt token's attention is half its cost
        self.pool = pool
        if config.state_slots and pool.prefix_caching:
            raise ValueError("a hybrid model's state is one per request, not per block: prefix caching must be off")
        self.tables = BlockTables(pool, window, StateSlots(config.state_slots) if config.state_slots else None)
        self.queues = Queues()
        self.moves: list = []  # block copies decided since the last take_moves(), in order
        self.preemption = Preemption(self.queues, self.tables, stats, config.max_seqs, config.swap_blocks,
                                     config.immunity_tokens, self.moves)
        if config.swap_blocks and pool.prefix_caching:  # evicted cached blocks go to the host pool
            pool.host = HostTier(config.swap_blocks, self.moves, lambda: self.preemption.swap_used)
        self.stats = stats  # the planner counts prompt tokens and prefix-cache hits
        self.aborts: set[str] = set()  # pending, including ids not seen yet (carried)
        self.in_flight: list[StepPlan] = []  # planned and not yet landed (or failed), oldest first
        self.speculation = Speculation(config.speculative) if config.speculative else None
        self.admitted = Admitted()

    def add(self, request: Request) -> None:
        self.queues.add(request)

    def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)

    def abort_all(self) -> None:
        self.aborts.update(self.queues.requests)

    def finish(self, request: Request, reason: str, stop_reason=None, error: str | None = None) -> None:
        """Mark a request done. It leaves, and frees its blocks, in retire()."""
        self.queues.finish(request, reason, stop_reason, error)

    # -- what the engine reads --------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        """A live request: added and not retired yet."""
        return request_id in self.queues.requests

    @property
    def has_work(self) -> bool:
        return bool(self.queues.requests)

    def view(self) -> PlannerView:
        q = self.queues
        return PlannerView(q.num_running, len(q.waiting), len(q.preempted), tuple(q.decoding))

    def held_tokens(self) -> int:
        """The tokens of every live request, prompt and output."""
        return sum(r.num_tokens for r in self.queues.requests.values())

    def take_admitted(self) -> Admitted:
        """What was admitted since the last call."""
        admitted, self.admitted = self.admitted, Admitted()
        return admitted

    # -- the tick -------------------------------------------------------------------------------

    def start_tick(self) -> TickStart:
        self.apply_aborts()
        retired = self.retire()
        self.preemption.resume()
        return TickStart(retired, self.take_moves())

    def take_moves(self) -> list:
        """The moves decided since the last call, in order (a failed one's fallback adds more)."""
        moves = self.moves[:]
        self.moves.clear()
        return moves

    def schedule(self) -> Schedule:
        """Decode rows first (with their guesses, when speculating), then prefill chunks in the
        step's tokens left."""
        self.admit()
        flying = {r.request_id: r for r in self.in_flight[-1].rows} if self.in_flight else {}
        planned = self.plan_decode(flying)
        if planned is None:
            return Schedule(None, self.take_moves(), [])
        if self.speculation:
            self.speculation.add_guesses(planned, self.tables, self.config.max_batched_tokens - len(planned))
        planned += self.plan_prefill(sum(len(row.token_ids) for _, row in planned), flying)
        step = StepPlan([row for _, row in planned])
        if step.rows:
            self.in_flight.append(step)
        return Schedule(step, self.take_moves(), [request for request, _ in planned])

    def apply_aborts(self) -> None:
        """Cancel where each request lives; ids not seen yet stay pending."""
        for request_id in list(self.aborts):
            request = self.queues.requests.get(request_id)
            if request is None:
                continue
            self.aborts.discard(request_id)
            if request.schedule.state is not State.FINISHED:
                self.finish(request, "cancelled")

    def retire(self) -> list[Request]:
        """The finished requests, gone from the planner with their blocks freed; a host copy
        (schedule.spilled) is left for the engine to drop."""
        retired = self.queues.take_finished()
        for request in retired:
            self.tables.release(request)
            self.preemption.forget(request)
            self.aborts.discard(request.id)  # one that came in while it finished has nothing to end
            if self.speculation:
                self.speculation.release(request.id)
        return retired

    # -- admission and planning -------------------------------------------------------------------

    def admit(self) -> None:
        """Strict FIFO: a head that does not fit stops the line. Preempted requests are older
        than anything waiting, so nothing is admitted while one waits to resume."""
        q = self.queues
        while q.waiting and not q.preempted:
            if q.num_running >= self.config.max_seqs or self.prefill_budget(len(q.decoding)) <= 0:
                break
            request = q.waiting[0]
            prompt = len(request.prompt_ids)
            if not self.tables.take(request, request.prompt_ids, prompt):
                break
            q.started(request, prompt)
            request.schedule.scheduled_at = time.monotonic()
            cached = request.schedule.cached_tokens
            self.stats.prompt_tokens += prompt
            self.stats.prefix_cache_queries += prompt
            self.stats.prefix_cache_hits += cached
            self.stats.prefix_cache_host_hits += request.schedule.host_cached
            self.admitted.seqs += 1
            self.admitted.new_tokens += prompt - cached
            self.admitted.cached_tokens += cached

    def prefill_budget(self, decode_rows: int) -> int:
        """Prefill tokens a step can carry beside its decode rows. Admission needs it to be
        positive; the admitted requests then share it round-robin."""
        chunk = self.config.prefill_chunk
        if decode_rows and self.config.prefill_beside_decode:
            chunk = min(chunk, self.config.prefill_beside_decode)
        return min(chunk, self.config.max_batched_tokens - decode_rows)

    def plan_decode(self, flying: dict) -> list[tuple[Request, Row]] | None:
        """flying: the rows of the step in flight, by request id. None when a row needs a block
        that only preemption could free while that step runs."""
        planned = []
        for request in sorted(self.queues.decoding, key=lambda r: r.schedule.seq):
            if request.schedule.state is not State.DECODING:
                continue  # preempted by an older row of this same step
            ahead = request.id in flying
            if ahead and (len(request.output_ids) + 1 >= request.max_tokens or request.waits_for_last_token):
                continue  # its next row depends on the token in flight
            while not self.tables.grow(request, request.num_tokens - 1 + ahead):
                if flying:
                    return None
                if not self.preemption.make_room(request):
                    break
            if request.schedule.state is State.DECODING:
                planned.append((request, ahead))
        return [(r, self.decode_row(r, ahead)) for r, ahead in planned if r.schedule.state is State.DECODING]

    def decode_row(self, request: Request, ahead: bool) -> Row:
        """ahead: fed the token the step in flight samples, at the position after it."""
        last = AHEAD if ahead else request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
        return Row(request.id, [last], request.num_tokens - 1 + ahead, self.tables.table(request), sample=True,
                   prompt_ids=request.prompt_ids, output_ids=request.output_ids, state_slot=request.schedule.state_slot,
                   adapter=request.params.adapter)

    def plan_prefill(self, decode_rows: int, flying: dict) -> list[tuple[Request, Row]]:
        """Up to prefill_chunk tokens, round-robin: each prefilling request in turn gets a chunk,
        and the ones served go to the back of the line for the next step. A chunk in flight
        counts as computed. Beside decode rows, the budget is prefill_beside_decode and of time
        rather than tokens (see token_cost), so streams wait no longer for a chunk deep in a long
        prompt than for one at its start; a chunk keeps MIN_CHUNK tokens, below which the
        GEMMs slow the prompt more than the streams gain. Alone, a prompt takes whole chunks."""
        budget = float(self.prefill_budget(decode_rows))
        planned = []
        for request in list(self.queues.prefilling):
            if budget < 1:
                break
            chunk = flying.get(request.id)
            start = request.schedule.num_computed + (len(chunk.token_ids) if chunk is not None else 0)
            cost = self.token_cost(start) if decode_rows else 1.0
            n = min(request.target - start, max(min(MIN_CHUNK, int(budget)), int(budget / cost)))
            if n <= 0 or request.schedule.host_loads:
                continue  # its last chunk is in flight, or its cached prefix is still coming from the host
            budget -= n * cost
            end = start + n
            last = end == request.target and not request.output_ids
            p = request.params
            planned.append((request, Row(
                request.id, request.all_ids[start:end], start, self.tables.table(request),
                sample=last and not p.embed and request.max_tokens > 0, prompt_ids=request.prompt_ids,
                output_ids=request.output_ids, embed=last and p.embed,
                prompt_logprobs=None if request.output_ids else p.prompt_logprobs,
                state_slot=request.schedule.state_slot, adapter=p.adapter)))
        for request, _ in planned:
            self.queues.move(request, State.PREFILLING)  # to the back of the line
        return planned

    def token_cost(self, position: int) -> float:
        """A prompt token's time at position, in tokens at position 0: its attention reads every
        position before it (within a sliding window), and at break_even that takes as long as
        the rest of it."""
        if not self.break_even:
            return 1.0
        return 1.0 + (min(position, self.tables.window) if self.tables.window else position) / self.break_even

    # -- what the engine reports back ---------------------------------------------------------------

    def spill_saved(self, spill: Spill, host_copy, state=None) -> None:
        self.preemption.spill_saved(spill, host_copy, state)

    def spill_failed(self, spill: Spill) -> None:
        self.preemption.spill_failed(spill)

    def reload_failed(self, reload: Reload) -> None:
        self.preemption.reload_failed(reload)

    def host_save_failed(self, save: HostSave) -> None:
        self.pool.host.lost(save.entry)

    def host_load_wanted(self, load: HostLoad) -> bool:
        """Its request still holds that table (no earlier load of it failed)."""
        s = load.request.schedule
        return s.state is not State.FINISHED and s.host_epoch == load.epoch

    def host_loaded(self, load: HostLoad, ok: bool) -> None:
        """A host-tier load into a request's table was done (ok) or failed. On failure the
        request gives its table up and takes one again from the device cache alone (or waits
        among the preempted when the pool cannot hold it now); its cached tokens count less."""
        request, s = load.request, load.request.schedule
        if not self.host_load_wanted(load):
            return
        s.host_loads -= 1
        if ok:
            return
        self.tables.release(request)
        s.host_epoch += 1
        s.host_loads = 0
        if self.tables.take(request, request.all_ids, request.target, host=False):
            self.queues.started(request, request.target)
        else:
            s.num_computed = s.num_offered = 0
            self.queues.move(request, State.PREEMPTED)
        if load.counted:
            self.stats.prefix_cache_hits -= s.cached_tokens - s.num_computed
            self.stats.prefix_cache_host_hits -= s.host_cached
            s.cached_tokens, s.host_cached = s.num_computed, 0

    def landed(self, plan: StepPlan) -> list[tuple[Request, Row]]:
        """A step's rows are computed: their K/V counts, full blocks go to the prefix cache, and
        a finished prefill decodes (or ends: max_tokens 0). Returns the requests of its rows with
        a result (sampled, embedded, or prompt logprobs); a request that ended while the step ran
        (the overlapped loop) has its row's result dropped."""
        self.in_flight = [p for p in self.in_flight if p is not plan]
        sampling = []
        for row in plan.rows:
            request = self.queues.requests.get(row.request_id)
            if request is None or request.schedule.state is State.FINISHED:
                continue
            s = request.schedule
            s.num_computed += len(row.token_ids) - row.num_draft  # guesses count once verified
            self.tables.offer_full_blocks(request)
            self.tables.drop_outside_window(request)
            if s.state is State.PREFILLING and s.num_computed == request.target:
                self.queues.move(request, State.DECODING)
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
        if request.schedule.state is State.FINISHED:
            return
        request.schedule.num_computed += appended - 1
        self.tables.offer_full_blocks(request)
        self.tables.drop_outside_window(request)
        self.tables.trim(request)

    def fail(self, plan: StepPlan, message: str) -> None:
        """The runner raised: every row of that step ends with an error (the engine waits for
        the rows' masks first, so no matcher is in use when its request ends)."""
        self.in_flight = [p for p in self.in_flight if p is not plan]
        for row in plan.rows:
            request = self.queues.requests.get(row.request_id)
            if request is not None and request.schedule.state is not State.FINISHED:
                self.finish(request, "error", error=message)
