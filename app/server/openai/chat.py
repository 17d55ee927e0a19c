"""/v1/chat/completions: a generation's text split into reasoning, content and tool calls,
as OpenAI's chat.completion reply or chat.completion.chunk stream, with chat's logprobs.

The role comes in an opening chunk of its own, as OpenAI's does; a choice's text is split as
it streams, so a tool call's arguments stream as they are written.
"""

from app.server.chat_text import ChatText, Reading
from app.server.generation import Generation, Piece
from app.server.openai.responder import Responder
from app.server.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    ToolCallChunk,
    TopLogprob,
)
from app.server.schemas import ToolCall


class ChatResponder(Responder):
    chunk_model = ChatCompletionChunk

    def __init__(self, gen: Generation, reading: Reading, req, tokenizer, model_name: str):
        super().__init__(gen, req, tokenizer, model_name)
        self.reading = reading
        self.splits = {rid: ChatText(reading) for rid in gen.choices}

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
        if not pieces:
            return [self.opening()]
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
            split = ChatText(self.reading)
            reasoning, content, _ = split.feed(c.text, final=True)
            calls = split.tool_calls
            message = ResponseMessage(content=content if content.strip() or not calls else None,
                                      tool_calls=[ToolCall(**call) for call in calls] or None,
                                      reasoning_content=reasoning if split.thinks else None)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self.logprobs(c.logprobs) if self.req.logprobs else None,
                                      finish_reason=split.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.gen.id, model=self.model_name, choices=choices, usage=self.gen.usage(),
                                      prompt_logprobs=self.prompt_logprobs(self.gen.ordered()[0])).model_dump()
