"""What the transports ask of every responder: the chunks of a batch (the first batch, empty,
opens the stream), the usage chunk and the whole reply; the shapes differ only in how they fill
these.

A responder is made per request, after its Generation, and keeps what a stream carries from
one batch to the next (the text split so far, the logprob offsets).
"""

from abc import ABC, abstractmethod

from pydantic import BaseModel

from app.server.generation import Choice, Generation, Piece
from app.server.openai.schemas import PromptLogprob, PromptLogprobs


class Responder(ABC):
    chunk_model: type[BaseModel]  # the shape of a streamed chunk

    def __init__(self, gen: Generation, req, tokenizer, model_name: str):
        self.gen, self.req, self.tokenizer, self.model_name = gen, req, tokenizer, model_name

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs, when the request asked: null for the first token, then each
        token's entry and those of the most likely tokens at its position."""
        n = self.req.prompt_logprobs
        if n is None:
            return None
        out: PromptLogprobs = [None]
        for token, logprob, rank, top in choice.prompt_logprobs:
            entry = {str(token): PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text(token))}
            for k, (t, lp) in enumerate(top[:n], start=1):
                entry.setdefault(str(t), PromptLogprob(logprob=lp, rank=k, decoded_token=self.token_text(t)))
            out.append(entry)
        return out

    @abstractmethod
    def chunks(self, pieces: list[Piece]) -> list[BaseModel]:
        """The chunks one batch of frames makes (none when it settles nothing yet); the first
        batch, empty, comes as the choices are submitted, before any frame."""

    def usage_chunk(self) -> BaseModel:
        """A last chunk with no choices that carries the usage, as OpenAI's does."""
        return self.chunk_model(id=self.gen.id, model=self.model_name, choices=[], usage=self.gen.usage())

    @abstractmethod
    def reply(self) -> dict:
        """The JSON body once every choice has ended."""
