"""/v1/completions: a generation's text as OpenAI's text_completion reply or stream, with the
completions shape of logprobs (parallel lists, and each token's offset in the text).
"""

from app.server.generation import Generation, Piece
from app.server.responders.base import Responder
from app.server.schemas import CompletionChoice, CompletionLogprobs, CompletionResponse


class CompletionResponder(Responder):
    chunk_model = CompletionResponse

    def __init__(self, gen: Generation, req, tokenizer, model_name: str):
        super().__init__(gen, req, tokenizer, model_name)
        self.offsets = {rid: 0 for rid in gen.choices}  # how much text each choice has streamed

    def logprobs(self, entries, offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, logprob, top in entries:
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append({self.token_text(t): lp for t, lp in top or []})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chunks(self, pieces: list[Piece]) -> list[CompletionResponse]:
        chunks = []
        for piece in pieces:
            rid, final = piece.choice.request_id, piece.final
            if not piece.text and final is None:
                continue
            lp = self.logprobs(piece.logprobs, self.offsets[rid]) if self.req.logprobs is not None else None
            self.offsets[rid] += len(piece.text)
            chunks.append(CompletionResponse(id=self.gen.id, model=self.model_name, choices=[CompletionChoice(
                index=piece.choice.index, text=piece.text, logprobs=lp,
                finish_reason=final.finish_reason if final else None,
                stop_reason=final.stop_reason if final else None)]))
        return chunks

    def reply(self) -> dict:
        choices = [CompletionChoice(index=c.index, text=c.text,
                                    logprobs=self.logprobs(c.logprobs, 0) if self.req.logprobs is not None else None,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in self.gen.ordered()]
        return CompletionResponse(id=self.gen.id, model=self.model_name, choices=choices,
                                  usage=self.gen.usage()).model_dump()
