"""The quart-trio application: OpenAI routes, health, metrics, tokenize, and the WebSocket.

create_app() builds a fresh app around a running Engine (Quart creates serving hooks once per
app, so tests build one per server).
"""

import json
import logging
from dataclasses import dataclass, field

import trio
from quart import request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from app.server import chat_page, metrics, openapi, worker_routes
from app.server.errors import APIError, decode_json, validate
from app.server.generation import RETRY_AFTER_SECONDS, ChatText, Generation, chat_prompt, merge, start_generation
from app.server.limits import Limits
from app.server.listener import ConnectionStats
from app.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenizeRequest,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
)
from app.server.tools import ToolUse
from app.server.websocket import serve_websocket

log = logging.getLogger("spool.server")
http_log = logging.getLogger("spool.http")

@dataclass
class ServerState:
    model_name: str
    engine: object = None  # None while the model loads
    tokenizer: object = None
    max_model_len: int = 0
    api_key: str | None = None
    ui: bool = True  # serve the chat page at /
    backend: str = ""  # "cpu (q8_0)", once loaded
    model_path: str = ""  # the Hugging Face directory served, once loaded
    model_type: str = ""
    architectures: list = field(default_factory=list)
    request_timeout: float | None = None  # seconds; None: no limit
    limits: Limits = field(default_factory=Limits)
    connections: ConnectionStats = field(default_factory=ConnectionStats)

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def deadline(self) -> float:
        return trio.current_time() + self.request_timeout if self.request_timeout else float("inf")

    def timeout_error(self) -> APIError:
        return APIError(504, f"the request took longer than --request-timeout ({self.request_timeout:g} s)",
                        code="timeout")


def parse(model, raw: bytes):
    return validate(model, decode_json(raw or b"null"))


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {body}\n\n"


def create_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("spool")
    app.config["MAX_CONTENT_LENGTH"] = state.limits.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # Spool enforces --request-timeout itself
    app.config["BODY_TIMEOUT"] = state.limits.body_timeout

    @app.before_request
    async def read_body_and_check_key():
        public = request.path == "/health" or (state.ui and chat_page.is_page(request.path))
        if state.engine is None and not public:
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": "5"})
        if state.api_key and not public:
            if request.headers.get("Authorization", "") != f"Bearer {state.api_key}":
                raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
        if request.method in ("POST", "PUT", "PATCH"):
            await request.get_data()  # an unread body would hang the keep-alive connection

    @app.after_request
    async def log_request(response):
        """Every request's method, path and status, as uvicorn logs them for vLLM: what a router
        asks of a worker shows in its log."""
        http_log.info(f"{request.remote_addr} {request.method} {request.path} {response.status_code}")
        return response

    @app.errorhandler(APIError)
    async def api_error(e: APIError):
        response = e.response()
        if e.status in (408, 413):  # the rest of the body is never read
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):
        message = {413: f"the request body is over --max-body-bytes ({state.limits.max_body_bytes})",
                   408: f"the request body took longer than --body-timeout ({state.limits.body_timeout:g} s)"
                   }.get(e.code, e.description or e.name)
        return await api_error(APIError(e.code or 500, message))

    @app.errorhandler(Exception)
    async def crash(e: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}").response()

    check_model, deadline, timeout_error = state.check_model, state.deadline, state.timeout_error

    def token_text(token_id: int) -> str:
        return state.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(entries) -> ChoiceLogprobs:
        content = []
        for token_id, logprob, top in entries:
            text = token_text(token_id)
            content.append(TokenLogprob(
                token=text, logprob=logprob, bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode()))
                              for t, lp in top or []]))
        return ChoiceLogprobs(content=content)

    def completion_logprobs(entries, offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, logprob, top in entries:
            text = token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append({token_text(t): lp for t, lp in top or []})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    async def stream(gen: Generation, chunk_for, usage_chunk):
        """SSE events until every choice ends; the choices are aborted if the client leaves."""
        try:
            try:
                gen.submit()
            except APIError as e:
                yield sse(json.dumps(e.body()))
                yield "data: [DONE]\n\n"
                return
            first = chunk_for(None)
            if first is not None:
                yield sse(first)
            until = deadline()
            while not gen.done:
                frames = await gen.next_frames(until)
                if frames is None:
                    yield sse(json.dumps(timeout_error().body()))
                    break
                for payload in chunk_for(frames):
                    yield sse(payload)
            failure = gen.failure()
            if failure:
                yield sse(json.dumps(failure.body()))
            elif usage_chunk is not None:
                yield sse(usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            gen.abort()
            gen.log()

    def streamed(gen: Generation, req, chunk_for, chunk_model):
        """The SSE response; with stream_options.include_usage, a last chunk with no choices
        carries the usage, as OpenAI's does."""
        usage_chunk = None
        if req.stream_options and req.stream_options.include_usage:
            def usage_chunk():
                return chunk_model(id=gen.id, model=state.model_name, choices=[], usage=gen.usage())
        return stream(gen, chunk_for, usage_chunk), {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

    async def respond_or_raise(gen: Generation):
        try:
            gen.submit()
            if not await gen.run_to_end(deadline()):
                raise timeout_error()
        finally:
            gen.abort()
            gen.log()
        failure = gen.failure()
        if failure:
            raise failure

    @app.post("/v1/chat/completions")
    async def chat_completions():
        req = parse(ChatCompletionRequest, await request.get_data())
        check_model(req.model)
        gen = start_generation(state.engine, state.tokenizer, req, "chatcmpl")
        model = state.model_name

        if not req.stream:
            await respond_or_raise(gen)
            choices = []
            for c in sorted(gen.choices.values(), key=lambda c: c.index):
                split = ChatText(gen)
                reasoning, content, _ = split.feed(c.text, final=True)
                calls = split.tool_calls
                message = ResponseMessage(content=content if content.strip() or not calls else None,
                                          tool_calls=[ToolCall(**call) for call in calls] or None,
                                          reasoning_content=reasoning if split.reasoning else None)
                choices.append(ChatChoice(index=c.index, message=message,
                                          logprobs=chat_logprobs(c.logprobs) if req.logprobs else None,
                                          finish_reason=split.finish_reason(c.finish_reason),
                                          stop_reason=c.stop_reason))
            return ChatCompletionResponse(id=gen.id, model=model, choices=choices,
                                          usage=gen.usage()).model_dump()

        splits = {rid: ChatText(gen) for rid in gen.choices}

        def chunk_for(frames):
            if frames is None:  # the opening chunk carries the role, as OpenAI's does
                return ChatCompletionChunk(id=gen.id, model=model, choices=[
                    ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                    for c in gen.choices.values()])
            chunks = []
            for rid, (text, logprobs, final) in merge(frames).items():
                split = splits[rid]
                reasoning, content, calls = split.feed(text, final=final is not None)
                logprobs = logprobs if req.logprobs else []
                if not reasoning and not content and not calls and not logprobs and final is None:
                    continue
                delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                                     tool_calls=[ToolCallChunk(**c) for c in calls] or None)
                chunks.append(ChatCompletionChunk(id=gen.id, model=model, choices=[ChatChunkChoice(
                    index=gen.choices[rid].index, delta=delta, logprobs=chat_logprobs(logprobs) if logprobs else None,
                    finish_reason=split.finish_reason(final.finish_reason) if final else None,
                    stop_reason=final.stop_reason if final else None)]))
            return chunks

        return streamed(gen, req, chunk_for, ChatCompletionChunk)

    @app.post("/v1/completions")
    async def completions():
        req = parse(CompletionRequest, await request.get_data())
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        gen = start_generation(state.engine, state.tokenizer, req, "cmpl")
        model = state.model_name

        if not req.stream:
            await respond_or_raise(gen)
            choices = [CompletionChoice(index=c.index, text=c.text,
                                        logprobs=completion_logprobs(c.logprobs, 0) if req.logprobs is not None else None,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                       for c in sorted(gen.choices.values(), key=lambda c: c.index)]
            return CompletionResponse(id=gen.id, model=model, choices=choices, usage=gen.usage()).model_dump()

        offsets = {rid: 0 for rid in gen.choices}

        def chunk_for(frames):
            if frames is None:
                return None
            chunks = []
            for rid, (text, logprobs, final) in merge(frames).items():
                if not text and final is None:
                    continue
                lp = completion_logprobs(logprobs, offsets[rid]) if req.logprobs is not None else None
                offsets[rid] += len(text)
                chunks.append(CompletionResponse(id=gen.id, model=model, choices=[CompletionChoice(
                    index=gen.choices[rid].index, text=text, logprobs=lp,
                    finish_reason=final.finish_reason if final else None,
                    stop_reason=final.stop_reason if final else None)]))
            return chunks

        return streamed(gen, req, chunk_for, CompletionResponse)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)]).model_dump()

    @app.get("/health")
    async def health():
        if state.engine is None:
            return APIError(503, "the model is still loading", code="loading").response()
        status = state.engine.status()
        if status["running"]:
            return {"status": "ok"}
        reason = "draining" if status["draining"] else "the engine is not running"
        return APIError(503, reason, code="unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render(state.engine, state.model_name, state.backend, state.connections)
        return body, 200, {"Content-Type": content_type}

    @app.post("/tokenize")
    async def tokenize():
        req = parse(TokenizeRequest, await request.get_data())
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            tokens = chat_prompt(state.tokenizer, req.messages, ToolUse.of(req), req.add_generation_prompt)
        else:
            tokens = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize():
        req = parse(DetokenizeRequest, await request.get_data())
        check_model(req.model)
        vocab = state.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/openapi.json")
    async def openapi_spec():
        return openapi.spec(state.model_name)

    @app.websocket("/v1/ws")
    async def websocket_route():
        if state.api_key and not chat_page.key_offered(websocket, state.api_key):
            await websocket.close(1008, "missing or invalid API key")  # 1008: policy violation
            return
        if state.engine is None:
            await websocket.close(1013, "the model is still loading")  # 1013: try again later
            return
        if chat_page.SUBPROTOCOL in websocket.requested_subprotocols:  # a browser must get one back
            await websocket.accept(subprotocol=chat_page.SUBPROTOCOL)
        await serve_websocket(state)

    worker_routes.add_routes(app, state)
    if state.ui:
        chat_page.add_routes(app)

    return app
