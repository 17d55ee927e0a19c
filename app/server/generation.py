"""One API request's generation: its choices checked in a worker thread (check_choices), then
submitted, their frames collected, and aborted however it ends. run() is the one stream loop:
it yields batches of pieces, then one Outcome, and each transport (the APIs' SSE, the
WebSocket, collect() for JSON) maps those to its wire format and does nothing else. The
request's log line (app/server/access_log.py) reads its tokens, TTFT and finish reasons.

Each wait for frames runs in its own cancel scope under the request's deadline
(--request-timeout, counted from submit). Whatever ends it (every choice done, the client
gone, a WebSocket cancel frame, the deadline, shutdown), leaving run() calls engine.abort
for every choice still running, so the engine sends each its one final frame. All n
choices share one channel; a reader takes every frame already waiting before it writes, so a
client that falls behind gets fewer, larger chunks instead of a backlog.
"""

import math
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field

import trio

from app.engine import Draining, EngineError, Frame, GenerationParams, Overloaded
from app.engine.errors import RequestFault
from app.server import access_log
from app.server.errors import APIError
from app.server.schemas import UsageInfo

RETRY_AFTER_SECONDS = 1


def engine_error(e: EngineError) -> APIError:
    if isinstance(e, Overloaded):
        return APIError(429, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, Draining):
        return APIError(503, str(e), code="draining", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return APIError(400, str(e), param=e.param)


@dataclass
class Choice:
    """One submitted generation, and what it has produced so far."""

    index: int
    request_id: str
    prompt_index: int  # which prompt of the request it continues
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    embedding: object = None  # an embedding request's vector
    prompt_logprobs: list = field(default_factory=list)  # per prompt token but the first, when asked

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Piece:
    """What one choice's consecutive frames in a batch say, joined; final: its last frame."""

    choice: Choice
    text: str
    logprobs: list
    final: Frame | None


@dataclass
class Submission:
    """One choice as the engine checked it: what engine.submit takes."""

    prompt_index: int  # which prompt of the request it continues
    prompt_ids: list[int]
    params: GenerationParams
    max_tokens: int  # resolved against the context by engine.check


def check_choices(engine, prompts: list[list[int]], n: int, params: Iterable[GenerationParams],
                  format_field: str | None = None) -> list[Submission]:
    """n choices per prompt, each checked by engine.check with its GenerationParams, taken from
    params in choice order. format_field: the request field its output format came from, named
    when it does not compile. Pure, so it runs off the event loop; the queue is asked later."""
    submissions = []
    choices = ((prompt_index, prompt) for prompt_index, prompt in enumerate(prompts) for _ in range(n))
    for (prompt_index, prompt), choice_params in zip(choices, params):
        try:
            max_tokens = engine.check(prompt, choice_params)
        except EngineError as e:
            if e.param == "grammar" and format_field:
                raise APIError(400, f"{format_field}: {e}", param=format_field) from None
            raise engine_error(e) from None
        submissions.append(Submission(prompt_index, prompt, choice_params, max_tokens))
    return submissions


@dataclass
class Outcome:
    """How a generation ended: the last item run() yields. refusal: the engine refused it at
    submit, so nothing ran; timeout: its deadline passed and every choice was aborted; failure:
    the first choice that ended in an engine error, as a 500. All None: every choice ended."""

    refusal: APIError | None = None
    timeout: APIError | None = None
    failure: APIError | None = None

    @property
    def error(self) -> APIError | None:
        """The one error a reply that carries one reports: the first that happened."""
        return self.refusal or self.timeout or self.failure


class Generation:
    """The n choices of one API request: made on the event loop from its checked choices (a
    draining server or a queue without room for them all refuses it here), run by run()."""

    def __init__(self, engine, submissions: list[Submission], id_prefix: str, timeout: float | None):
        """timeout: seconds from submit to the deadline, None for none."""
        try:
            engine.admits(len(submissions))
        except EngineError as e:
            raise engine_error(e) from None
        self.engine = engine
        self.timeout = timeout
        self.id = f"{id_prefix}-{engine.next_id()}"
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.deadline = math.inf
        self.send, self.recv = trio.open_memory_channel(math.inf)
        self.choices: dict[str, Choice] = {}
        self.submissions = []
        for index, submission in enumerate(submissions):
            rid = f"{self.id}-{index}"
            self.submissions.append((rid, submission))
            self.choices[rid] = Choice(index, rid, submission.prompt_index, submission.prompt_ids)
        access_log.attach(self)

    async def run(self) -> AsyncIterator[list[Piece] | Outcome]:
        """The one stream loop: submits every choice, then yields an empty batch (a stream opens
        there, before the first token), then every frame waiting each time, joined per choice,
        until every choice has ended or the deadline passed; last, one Outcome (alone, when the
        engine refused it). However it is left (run to its end, the client gone, a cancel frame,
        shutdown), aborts every choice still running; callers hold it in contextlib.aclosing,
        so that happens as they leave, not when the generator is collected."""
        try:
            try:
                self._submit()
            except APIError as refusal:
                yield Outcome(refusal=refusal)
                return
            yield []
            while not self.done:
                frames = await self._next_frames()
                if frames is None:
                    self.abort()
                    yield Outcome(timeout=self.timeout_error(), failure=self.failure())
                    return
                yield self._pieces(frames)
            yield Outcome(failure=self.failure())
        finally:
            self.abort()

    def _submit(self) -> None:
        submitted = []
        try:
            for rid, submission in self.submissions:
                self.engine.submit(submission.prompt_ids, submission.params, request_id=rid, channel=self.send,
                                   max_tokens=submission.max_tokens)
                submitted.append(rid)
        except EngineError as e:
            for rid in submitted:
                self.engine.abort(rid)
            for choice in self.choices.values():
                choice.finish_reason = choice.finish_reason or "error"
            raise engine_error(e) from None
        if self.timeout:
            self.deadline = trio.current_time() + self.timeout

    def abort(self) -> None:
        for rid, choice in self.choices.items():
            if choice.finish_reason is None:
                self.engine.abort(rid)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    def _pieces(self, frames: list[Frame]) -> list[Piece]:
        """A batch's frames, joined per choice."""
        pieces: dict[str, Piece] = {}
        for frame in frames:
            piece = pieces.setdefault(frame.request_id, Piece(self.choices[frame.request_id], "", [], None))
            piece.text += frame.text
            piece.logprobs += frame.logprobs or []
            piece.final = frame if frame.finish_reason else None
        return list(pieces.values())

    async def _next_frames(self) -> list[Frame] | None:
        """Every frame waiting now (at least one), or None when the deadline passed first."""
        with trio.move_on_at(self.deadline):
            frames = [await self.recv.receive()]
            while True:
                try:
                    frames.append(self.recv.receive_nowait())
                except trio.WouldBlock:
                    break
            now = time.monotonic()
            for frame in frames:
                choice = self.choices[frame.request_id]
                choice.text += frame.text
                choice.token_ids += frame.token_ids
                if frame.logprobs:
                    choice.logprobs += frame.logprobs
                if frame.prompt_logprobs:
                    choice.prompt_logprobs += frame.prompt_logprobs
                if frame.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if frame.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = frame.finish_reason, frame.stop_reason
                    choice.error, choice.embedding = frame.error, frame.embedding
                    choice.completion_tokens = frame.usage.completion_tokens
                    choice.cached_tokens = frame.usage.cached_tokens
            return frames
        return None

    async def collect(self) -> None:
        """Every choice run to its end, for a JSON reply; raises what stopped it: the refusal,
        the deadline, or an engine error."""
        async with aclosing(self.run()) as items:
            async for item in items:
                if isinstance(item, Outcome) and item.error:
                    raise item.error

    def timeout_error(self) -> APIError:
        return APIError(504, f"the request took longer than --request-timeout ({self.timeout:g} s)", code="timeout")

    def failure(self) -> "APIError | None":
        """The first choice that ended in an error: a 500, or a 400 where the request caused it."""
        errors = [c.error for c in self.choices.values() if c.finish_reason == "error"]
        if not errors:
            return None
        return APIError(400 if isinstance(errors[0], RequestFault) else 500, errors[0], code="generation_error")

    def ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def usage(self) -> UsageInfo:
        choices = list(self.choices.values())
        prompt = sum({c.prompt_index: c.prompt_tokens for c in choices}.values())  # each prompt once
        completion = sum(c.completion_tokens for c in choices)
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        cached: dict[int, int] = {}  # per prompt, as prompt_tokens counts each prompt once
        for c in choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        usage.prompt_tokens_details.cached_tokens = sum(cached.values())
        return usage
