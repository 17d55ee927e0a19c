"""The Trio engine: a tick loop over the planner, the output processor and the runner; each
request has its own memory channel of Frames.

The tick never awaits a client: frames go out with send_nowait, and a full or closed channel
aborts that request. The forward pass runs on the compute thread (model/compute.py), so
streams keep flowing.

A runner whose steps run on a device (`runner.overlaps`, the CUDA runner) gets the overlapped
loop: step N+1 is planned and launched before step N's sampled ids are awaited and applied, so
the device runs N+1 while the host applies N, sends its frames and plans N+2. What a plan may
see one step late is in planner.py's docstring. On the CPU the step is the host's own work,
and nothing would overlap: there the loop waits for each step before planning the next. So does
speculative decoding on a device: a row's next input is what the model kept of its guesses.

The planner decides which blocks move (reloads, spills, the prefix cache's host tier) and the
engine moves them through the runner (moves.py) before it launches the step, so a copy out reads
its blocks before any step reuses them.

submit() and abort() are synchronous and put their request or id straight into the planner's
waiting queue or pending-abort set. That is safe because Trio runs every task on one thread and
the tick touches the planner only between its awaits; the set is applied at the next step
boundary. (A channel in between would add a race: a value handed to a task already waiting on
the channel cannot be drained by the tick, so a step could run before an abort sent earlier.)
"""

import itertools
import math
import logging
import time
from dataclasses import dataclass, replace

import trio

from app.engine.block_pool import BlockPool
from app.engine.errors import Draining, EngineError, Overloaded
from app.engine.moves import carry_out
from app.engine.outputs import Ending, OutputProcessor
from app.engine.planner import Planner, PlannerConfig
from app.engine.request import GenerationParams, Request
from app.engine.stats import Stats
from app.engine.status import StatusReporter
from app.engine.validation import validate
from model import compute
from model.errors import is_failure, one_line
from model.runner import Sampled, StepPlan

log = logging.getLogger("spool.engine")

CHANNEL_FRAMES = 4096  # frames waiting unread: a client this far behind is treated as gone


async def computed(fn, *args):
    """fn(*args) on the compute thread, awaited without holding one of Trio's worker threads;
    the wait cannot be cancelled (a step is never abandoned halfway), as trio.to_thread.run_sync's."""
    token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()
    future = compute.submit(fn, *args)
    future.add_done_callback(lambda _: token.run_sync_soon(trio.lowlevel.reschedule, task))
    await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
    return future.result()


@dataclass
class EngineConfig(PlannerConfig):
    max_queue: int = 1024  # requests waiting; submit refuses more (Overloaded)
    prefix_caching: bool = True
    decode_log_interval: int = 40  # steps between Decode status lines; 0: none


def hybrid(config: EngineConfig, state_slots: int) -> EngineConfig:
    """config for a model with state slots (delta-net layers): its state is one per request, not
    per block, so prefixes are not cached (one log line says so). A preempted request's state is
    spilled with its K/V, or recomputed with it; a rejected guess's state is rewound by the
    runner (model/rewind.py)."""
    if not state_slots:
        return config
    if config.prefix_caching:
        log.info("hybrid model: prefix caching off (its delta-net state is one per request, not per block)")
    return replace(config, prefix_caching=False, state_slots=state_slots)


class Engine:
    def __init__(self, runner, tokenizer, config: EngineConfig):
        self.runner = runner
        # its steps run on a device: the overlapped loop, unless rows carry guesses, whose next
        # row depends on what the model kept (a device still runs each step off the event loop)
        self.overlaps = runner.overlaps and not config.speculative
        self.tokenizer = tokenizer
        config = hybrid(config, getattr(runner, "state_slots", 0))
        self.config = config
        self.pool = BlockPool(runner.num_blocks, runner.block_size, config.prefix_caching)
        self.stats = Stats()
        model = getattr(runner, "config", None)
        # a checkpoint's embedding often has more rows than its tokenizer has tokens (Qwen's
        # 151,936 for about 151,670): a request may name only ids both know (a grammar's mask
        # never allows the others: model.sampling.allowed_tokens)
        self.vocab_size = min(tokenizer.vocab_size, getattr(model, "vocab_size", tokenizer.vocab_size))
        self.outputs = OutputProcessor(tokenizer, self.stats)
        self.planner = Planner(config, self.pool, self.stats, getattr(model, "kv_window", 0),
                               getattr(runner, "prefill_break_even", 0.0))
        self.reporter = StatusReporter(config.decode_log_interval, self.pool, self.stats, self.planner.speculation)
        self._wake = trio.Event()
        self._ids = itertools.count()
        self.draining = False
        self.ticking = False  # the tick loop runs
        self.steps = 0

    # -- the public, synchronous side ----------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def check(self, prompt_ids: list[int], params: GenerationParams) -> int:
        """What could never run (EngineError), whatever the load; returns the resolved max_tokens.
        It reads only what never changes and the grammar cache (locked), so the server runs it
        in a worker thread, off the event loop."""
        return validate(prompt_ids, params, max_model_len=self.config.max_model_len, pool=self.pool,
                        vocab_size=self.vocab_size, grammars=self.outputs.grammars)

    def admits(self, count: int = 1) -> None:
        """Raises Draining, or Overloaded when count more requests would pass --max-queue."""
        if self.draining:
            raise Draining("the server is shutting down")
        if self.planner.view().waiting + count > self.config.max_queue:
            raise Overloaded(f"the queue is full ({self.config.max_queue} requests waiting); retry later")

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> int:
        """What submit would refuse, without submitting; returns the resolved max_tokens."""
        max_tokens = self.check(prompt_ids, params)
        self.admits()
        return max_tokens

    def submit(self, prompt_ids: list[int], params: GenerationParams, request_id: str | None = None,
               channel=None, max_tokens: int | None = None):
        """Queue a request; returns (request_id, receive channel of Frames). With channel (a
        send channel shared by several requests, told apart by Frame.request_id), frames go
        there and no receive channel is returned. max_tokens: what check() resolved for these
        prompt and params, when the caller checked them already; else they are checked here.
        Raises EngineError (invalid or could never fit), Overloaded or Draining."""
        if max_tokens is None:
            max_tokens = self.validate(prompt_ids, params)
        else:
            self.admits()
        request_id = request_id or f"req-{self.next_id()}"
        if request_id in self.planner:
            raise EngineError(f"request id {request_id!r} is already in use")
        send, recv = channel, None
        if channel is None:
            send, recv = trio.open_memory_channel(math.inf)

        def emit(frame):
            """Deltas stop going out once CHANNEL_FRAMES wait unread (the output processor then
            aborts the request); the final frame always goes out, so a reader never waits forever."""
            if frame.finish_reason is None and send.statistics().current_buffer_used >= CHANNEL_FRAMES:
                raise trio.WouldBlock
            send.send_nowait(frame)

        self.add(Request(request_id, list(prompt_ids), params, max_tokens, emit))
        self._wake.set()
        return request_id, recv

    def add(self, request: Request) -> None:
        """A request already validated (validate), into the waiting queue; EngineError when its
        detokenizer or grammar cannot be set up (a native library's panic included)."""
        try:
            self.outputs.open(request)
        except BaseException as e:
            if not is_failure(e):
                raise
            raise EngineError(f"the request cannot be set up: {type(e).__name__}: {one_line(e)}") from None
        self.planner.add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; takes effect at the next step boundary. Safe from
        any task, and for ids already finished."""
        if request_id in self.planner:  # unknown or finished ids are ignored
            self.planner.abort(request_id)
            self._wake.set()

    def status(self) -> dict:
        p = self.planner.view()
        return {
            "running": self.ticking and not self.draining,
            "draining": self.draining,
            "num_requests_running": p.running,
            "num_requests_waiting": p.waiting + p.preempted,
            "num_preempted": p.preempted,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.used,
            "kv_cache_usage_perc": self.pool.usage,
            "steps": self.steps,
            "stats": self.stats,
        }

    # -- one tick, synchronously: the planner's decisions carried out ----------------------------

    def next_step(self) -> StepPlan | None:
        """Plan the next step, each row with what it samples with from the output processor,
        and move the blocks it needs: retired requests closed, blocks copied between the device
        and the host through the runner, failures reported back to the planner. None: only
        preemption would make room while a step runs (wait for it, then plan again)."""
        start = self.planner.start_tick()
        self._close(start.retired)
        carry_out(self.planner, self.runner, start.moves)
        while True:
            schedule = self.planner.schedule()
            if schedule.step is not None:  # masks start now, on the grammars' thread
                for request, row in zip(schedule.requests, schedule.step.rows):
                    self.outputs.prepare(request, row)
            loaded = carry_out(self.planner, self.runner, schedule.moves)  # before the step, which may write their blocks
            # a request admitted with its prefix still on the host is planned once it is back:
            # plan again rather than idle with only it to run
            if not loaded or schedule.step is None or schedule.step.rows:
                return schedule.step

    def apply(self, plan: StepPlan, sampled: list[Sampled]) -> None:
        """A landed step: the planner counts its K/V, the output processor takes each sampled
        token and sends the deltas."""
        by_id: dict[str, list[Sampled]] = {}  # a row with guesses has one per sampled position
        for result in sampled:
            by_id.setdefault(result.request_id, []).append(result)
        now = time.monotonic()
        for request, row in self.planner.landed(plan):
            results = by_id.get(row.request_id, [])  # none for a chunk that predicts no prompt token
            if results and results[0].prompt_logprobs:
                self.outputs.score_prompt(request, results[0])
            if row.num_draft or row.draft_limit:
                self.verify(request, row, results, now)
            elif row.sample or row.embed:
                end = self.accept(request, results[0] if results else None, now)
                if end is not None:
                    self.planner.finish(request, end.reason, end.stop_reason, end.error)
        for request in self.outputs.send_deltas(self.planner.view().decoding):
            self.planner.finish(request, "cancelled")

    def verify(self, request: Request, row, results: list[Sampled], now: float) -> None:
        """A row with guesses: the model's tokens go out in order up to the first that differs
        from its guess (that one included, as the plain step would have sampled it), each
        through the same stop checks as any token."""
        guesses = row.token_ids[len(row.token_ids) - row.num_draft:]
        kept = next((j for j, guess in enumerate(guesses) if results[j].token_id != guess), row.num_draft)
        appended = 0
        for result in results[:kept + 1]:
            appended += 1
            end = self.accept(request, result, now)
            if end is not None:
                self.planner.finish(request, end.reason, end.stop_reason, end.error)
                break
        self.planner.verified(request, row, kept, appended)

    def accept(self, request: Request, result: Sampled | None, now: float) -> Ending | None:
        """The output processor takes one token; what it raises there (the grammar's matcher,
        the detokenizer, a native library's panic) ends this request alone, never the tick."""
        try:
            return self.outputs.accept(request, result, now)
        except BaseException as e:
            if not is_failure(e):
                raise
            log.error(f"request {request.id} failed on its token", exc_info=e)
            return Ending("error", error=f"the output could not be processed: {type(e).__name__}: {one_line(e)}")

    def retire(self) -> None:
        """The requests that finished: blocks freed, host copies and sampler state dropped,
        final frames sent."""
        self._close(self.planner.retire())

    def _close(self, retired: list[Request]) -> None:
        now = time.monotonic()
        for request in retired:
            if request.schedule.spilled is not None:
                self.runner.drop_spill(request.schedule.spilled)
                request.schedule.spilled = None
            self.runner.release(request.id)
            self.outputs.close(request, now)

    # -- the nursery ------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        """Run until cancelled. A runner that raises fails that step's rows and the engine
        goes on; anything else raising here is a crashed engine and propagates."""
        self.ticking = True
        task_status.started()
        try:
            await self._tick_loop()
        finally:
            self.ticking = False

    async def _tick_loop(self):
        in_flight = None  # (plan, Launched): launched, not yet landed
        while True:
            plan = self.next_step()
            if plan is None:  # only preemption would make room while a step runs: wait for it
                await self._land(*in_flight)
                in_flight = None
                continue
            self._report_admitted()
            launched = await self._launch(plan) if plan.rows else None
            landed, in_flight = in_flight, None
            if landed is not None:
                await self._land(*landed)
            if launched is not None:
                if self.overlaps:
                    in_flight = (plan, launched)
                else:
                    await self._land(plan, launched)
            self.retire()
            if not plan.rows and landed is None:  # idle, or blocked until a submission or an abort
                await self._wake.wait()
                self._wake = trio.Event()
    async def _launch(self, plan):
        """The step queued on the runner; None when that failed (its rows have then ended). A
        CPU step's ids are ready when its launch returns: they are collected in the same hop."""
        runner = self.runner
        try:
            if runner.overlaps:
                return await computed(runner.launch, plan)
            return await computed(lambda: runner.collect(runner.launch(plan)))
        except Exception as e:
            self._failed(plan, e)
            return None

    async def _land(self, plan, launched) -> None:
        """Wait for a launched step's sampled ids and apply them (a CPU step's: already collected)."""
        try:
            sampled = await computed(self.runner.collect, launched) if self.runner.overlaps else launched
        except Exception as e:
            self._failed(plan, e)
        else:
            self.apply(plan, sampled)
        self.steps += 1
        if self.reporter.decode_due():
            log.info(self.reporter.decode_line(self.planner.view(), self.planner.held_tokens()))

    def _failed(self, plan, error: Exception) -> None:
        """The runner failed: those rows end, the engine serves on."""
        log.error("forward step failed", exc_info=error)
        self.fail_step(plan, f"the model step failed: {type(error).__name__}: {error}")

    def fail_step(self, plan: StepPlan, message: str) -> None:
        """Every row of a failed step ends with message, once its mask is done with its matcher."""
        self.outputs.settle(plan)
        self.planner.fail(plan, message)

    def _report_admitted(self):
        admitted = self.planner.take_admitted()
        if admitted.seqs:
            log.info(self.reporter.prefill_line(admitted, self.planner.view()))

    # -- shutdown -----------------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Stop admitting, let running requests finish for up to grace seconds, then cancel
        the rest through the abort path and wait for their final frames."""
        self.draining = True
        with trio.move_on_after(grace):
            while self.planner.has_work:
                await trio.sleep(0.01)
        if self.planner.has_work:
            self.planner.abort_all()
            self._wake.set()
        while self.planner.has_work and self.ticking:
            await trio.sleep(0.01)
