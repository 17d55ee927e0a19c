"""/v1/chat/completions: a generation's text split into reasoning, content and tool calls,
as OpenAI's chat.completion reply or chat.completion.chunk stream, with chat's logprobs.

The role comes in an opening chunk of its own, as OpenAI's does; a choice's text is split as
it streams, so a tool call's arguments stream as they are written.
"""

from app.server.generation import Generation, Piece
from app.server.reasoning import ReasoningParser
from app.server.responders.base import Responder
from app.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
)


class ChatText:
    """One chat choice's text, as it streams, split into reasoning, content and tool calls."""

    def __init__(self, gen: Generation):
        self.reasoning = ReasoningParser(gen.thinks_from) if gen.thinks_from is not None else None
        self.calls = gen.tools.parser() if gen.tools else None
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


class ChatResponder(Responder):
    chunk_model = ChatCompletionChunk

    def __init__(self, gen: Generation, req, tokenizer, model_name: str):
        super().__init__(gen, req, tokenizer, model_name)
        self.splits = {rid: ChatText(gen) for rid in gen.choices}

    def logprobs(self, entries) -> ChoiceLogprobs:
        content = []
        for token_id, logprob, top in entries:
            text = self.token_text(token_id)
            content.append(TokenLogprob(
                token=text, logprob=logprob, bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=lp, bytes=list(self.token_text(t).encode()))
                              for t, lp in top or []]))
        return ChoiceLogprobs(content=content)

    def opening(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.gen.id, model=self.model_name, choices=[
            ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
            for c in self.gen.choices.values()])

    def chunks(self, pieces: list[Piece]) -> list[ChatCompletionChunk]:
        chunks = []
        for piece in pieces:
            split, final = self.splits[piece.choice.request_id], piece.final
            reasoning, content, calls = split.feed(piece.text, final=final is not None)
            logprobs = piece.logprobs if self.req.logprobs else []
            if not reasoning and not content and not calls and not logprobs and final is None:
                continue
            delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                                 tool_calls=[ToolCallChunk(**c) for c in calls] or None)
            chunks.append(ChatCompletionChunk(id=self.gen.id, model=self.model_name, choices=[ChatChunkChoice(
                index=piece.choice.index, delta=delta, logprobs=self.logprobs(logprobs) if logprobs else None,
                finish_reason=split.finish_reason(final.finish_reason) if final else None,
                stop_reason=final.stop_reason if final else None)]))
        return chunks

    def reply(self) -> dict:
        choices = []
        for c in self.gen.ordered():
            split = ChatText(self.gen)
            reasoning, content, _ = split.feed(c.text, final=True)
            calls = split.tool_calls
            message = ResponseMessage(content=content if content.strip() or not calls else None,
                                      tool_calls=[ToolCall(**call) for call in calls] or None,
                                      reasoning_content=reasoning if split.reasoning else None)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self.logprobs(c.logprobs) if self.req.logprobs else None,
                                      finish_reason=split.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.gen.id, model=self.model_name, choices=choices, usage=self.gen.usage(),
                                      prompt_logprobs=self.prompt_logprobs(self.gen.ordered()[0])).model_dump()
