"""From an API request to engine submissions, and from engine frames back to API chunks.

Shared by the HTTP routes and the WebSocket. All n choices of a request share one channel;
a reader takes every frame already waiting before it writes, so a client that falls behind
gets fewer, larger chunks instead of a backlog.
"""

import logging
import math
import time
from dataclasses import dataclass, field

import trio

from app.engine import Draining, EngineError, Frame, GenerationParams, Overloaded
from app.server.errors import APIError
from app.server.formats import grammar
from app.server.schemas import ChatCompletionRequest, UsageInfo
from app.server.reasoning import ReasoningParser, after_thinking, budget, opens_thinking
from app.server.tools import ToolCallParser, ToolUse, prompt_messages
from model.sampling import SamplingParams
from model.tokenizer import ChatTemplateError

access_log = logging.getLogger("spool.access")

RETRY_AFTER_SECONDS = 1


def sampling_params(req, logprobs: int | None, index: int) -> SamplingParams:
    """The request's sampling fields with OpenAI's defaults; the engine validates them."""
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        seed=None if req.seed is None else req.seed + index,
        logprobs=logprobs,
    )


def generation_params(req, index: int, grammar_text: str | None = None, thinking=None) -> GenerationParams:
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        logprobs = req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return GenerationParams(sampling_params(req, logprobs, index), max_tokens=max_tokens,
                            min_tokens=req.min_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                            ignore_eos=req.ignore_eos, grammar=grammar_text, thinking=thinking)


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
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class Generation:
    """The n choices of one API request: checked when made, submitted by submit().

    Routes make it (so a refusal is an HTTP status) and submit it inside the code that also
    aborts it in a `finally`, so a client that leaves before its stream starts cannot leave a
    generation running.
    """

    def __init__(self, engine, prompts: list[list[int]], n: int, params_for, id_prefix: str,
                 format_field: str | None = None, tools: ToolUse | None = None, thinks_from: bool | None = None):
        """n choices per prompt; params_for(choice index) gives each its GenerationParams.
        format_field: the request field its output format came from, named when it does not compile.
        tools: what a chat request asked of tools, for reading calls out of the text.
        thinks_from: for a reasoning model's chat, whether the prompt opened the thinking."""
        self.engine = engine
        self.tools = tools
        self.thinks_from = thinks_from
        self.id = f"{id_prefix}-{engine.next_id()}"
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.send, self.recv = trio.open_memory_channel(math.inf)
        self.choices: dict[str, Choice] = {}
        self.submissions = []
        for prompt_index, prompt in enumerate(prompts):
            for i in range(n):
                index = prompt_index * n + i
                params = params_for(index)
                try:
                    engine.check(prompt, params)
                except EngineError as e:
                    if e.param == "grammar" and format_field:
                        raise APIError(400, f"{format_field}: {e}", param=format_field) from None
                    raise engine_error(e) from None
                rid = f"{self.id}-{index}"
                self.submissions.append((rid, prompt, params))
                self.choices[rid] = Choice(index, rid, prompt_index, len(prompt))

    def submit(self) -> None:
        submitted = []
        try:
            for rid, prompt, params in self.submissions:
                self.engine.submit(prompt, params, request_id=rid, channel=self.send)
                submitted.append(rid)
        except EngineError as e:
            for rid in submitted:
                self.engine.abort(rid)
            for choice in self.choices.values():
                choice.finish_reason = choice.finish_reason or "error"
            raise engine_error(e) from None

    def abort(self) -> None:
        for rid, choice in self.choices.items():
            if choice.finish_reason is None:
                self.engine.abort(rid)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    async def next_frames(self, deadline: float) -> list[Frame] | None:
        """Every frame waiting now (at least one), or None when the deadline passed first."""
        with trio.move_on_at(deadline):
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
                if frame.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if frame.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = frame.finish_reason, frame.stop_reason
                    choice.error = frame.error
                    choice.completion_tokens = frame.usage.completion_tokens
                    choice.cached_tokens = frame.usage.cached_tokens
            return frames
        return None

    def failure(self) -> "APIError | None":
        """The first choice that ended in an engine error, as a 500."""
        errors = [c.error for c in self.choices.values() if c.finish_reason == "error"]
        return APIError(500, errors[0], code="generation_error") if errors else None

    async def run_to_end(self, deadline: float) -> bool:
        """Collect everything; False when the deadline passed (the choices are then aborted)."""
        while not self.done:
            if await self.next_frames(deadline) is None:
                return False
        return True

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

    def log(self) -> None:
        """The access log line: id, tokens, TTFT, total time, finish reasons."""
        usage = self.usage()
        ttft = f"{1000 * (self.first_token_at - self.started):.0f}ms" if self.first_token_at else "-"
        reasons = ",".join(sorted({c.finish_reason or "aborted" for c in self.choices.values()}))
        access_log.info(f"{self.id} prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
                        f" ttft={ttft} total={1000 * (time.monotonic() - self.started):.0f}ms finish={reasons}")


class ChatText:
    """One chat choice's text, as it streams, split into reasoning, content and tool calls."""

    def __init__(self, gen: Generation):
        self.reasoning = ReasoningParser(gen.thinks_from) if gen.thinks_from is not None else None
        self.calls = ToolCallParser() if gen.tools else None
        self.tools = gen.tools

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool call chunks) that text settles; final: all that is left."""
        reasoning, content, chunks = "", text, []
        if self.reasoning:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.calls:
            content, chunks = self.calls.feed(content)
            if final:
                content += self.calls.finish()
        return reasoning, content, chunks

    @property
    def tool_calls(self) -> list[dict]:
        """The calls read so far, each with all its arguments written so far."""
        return self.calls.calls if self.calls else []

    def finish_reason(self, reason: str) -> str:
        return self.tools.finish_reason(reason, bool(self.tool_calls)) if self.tools else reason


def merge(frames: list[Frame]) -> dict:
    """Consecutive frames per request id, joined: {id: (text, logprobs, final frame or None)}."""
    out: dict = {}
    for frame in frames:
        text, logprobs, _ = out.get(frame.request_id, ("", [], None))
        out[frame.request_id] = (text + frame.text, logprobs + (frame.logprobs or []),
                                 frame if frame.finish_reason else None)
    return out


def start_generation(engine, tokenizer, req, id_prefix: str) -> Generation:
    """Every choice of a chat or completion request, checked and ready to submit."""
    grammar_text, field = grammar(req)
    tools = ToolUse.of(req) if isinstance(req, ChatCompletionRequest) else None
    if tools is not None:
        if grammar_text is not None:
            raise APIError(400, f"give one output format, not tools and {field}", param=field)
        grammar_text, field = tools.grammar(), "tools"
    if not isinstance(req, ChatCompletionRequest):
        return Generation(engine, completion_prompts(req, tokenizer), req.n,
                          lambda index: generation_params(req, index, grammar_text), id_prefix, field)
    prompt = chat_prompt(tokenizer, req.messages, tools, req.add_generation_prompt)
    thinking = budget(tokenizer, prompt, req.max_thinking_tokens)
    inside = opens_thinking(tokenizer, prompt) if tokenizer.think_ids else None
    if grammar_text is not None and inside is not None:
        grammar_text = after_thinking(tokenizer, grammar_text, inside)
    return Generation(engine, [prompt], req.n, lambda index: generation_params(req, index, grammar_text, thinking),
                      id_prefix, field, tools, inside)


def chat_prompt(tokenizer, messages, tools: ToolUse | None, add_generation_prompt: bool) -> list[int]:
    """The token ids of a conversation after the chat template, with the tools it offers."""
    dicts = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
    dicts, extra = prompt_messages(dicts, tools, tokenizer.template_takes_tools)
    try:
        return tokenizer.encode_chat(dicts, add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def completion_prompts(req, tokenizer) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [tokenizer.encode(p)]
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, str) for x in p):
        return [tokenizer.encode(x) for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]
