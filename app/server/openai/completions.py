"""/v1/completions: a generation's text as OpenAI's text_completion reply or stream, with the
completions shape of logprobs (parallel lists, and each token's offset in the text).

With echo the prompt comes first (a stream's first chunk of each choice carries it), and with
logprobs its tokens carry theirs, the first one's null as OpenAI's is.
"""

from app.server.generation import Choice, Generation, Piece
from app.server.openai.responder import Responder
from app.server.openai.schemas import CompletionChoice, CompletionLogprobs, CompletionResponse


class CompletionResponder(Responder):
    chunk_model = CompletionResponse

    def __init__(self, gen: Generation, req, tokenizer, model_name: str):
        super().__init__(gen, req, tokenizer, model_name)
        self.offsets = {rid: 0 for rid in gen.choices}  # how much text each choice has streamed
        self.echoed: set[str] = set()  # streamed choices whose prompt has gone out

    def add_logprobs(self, out: CompletionLogprobs, entries, offset: int) -> None:
        for token_id, logprob, top in entries:
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(None if top is None else {self.token_text(t): lp for t, lp in top})
            out.text_offset.append(offset)
            offset += len(text)

    def prompt_text(self, choice: Choice) -> str:
        """The prompt as the request gave it: its text, or its token ids decoded."""
        p = self.req.prompt
        if isinstance(p, str):
            return p
        if all(isinstance(x, str) for x in p):
            return p[choice.prompt_index]
        return self.tokenizer.decode(choice.prompt_ids, skip_special_tokens=False)

    def prompt_entries(self, choice: Choice) -> list:
        """The prompt's tokens as logprob entries: the first without one."""
        first = (choice.prompt_ids[0], None, None)
        return [first] + [(t, lp, top[:self.req.logprobs]) for t, lp, _, top in choice.prompt_logprobs]

    def part(self, choice: Choice, text: str, entries, offset: int, echo: bool) -> tuple[str, CompletionLogprobs | None]:
        """A choice's text from offset on, after the prompt when echo, with their logprobs when asked."""
        lp = CompletionLogprobs() if self.req.logprobs is not None else None
        if echo:
            prompt = self.prompt_text(choice)
            if lp is not None:
                self.add_logprobs(lp, self.prompt_entries(choice), offset)
            text, offset = prompt + text, offset + len(prompt)
        if lp is not None:
            self.add_logprobs(lp, entries, offset)
        return text, lp

    def chunks(self, pieces: list[Piece]) -> list[CompletionResponse]:
        chunks = []
        for piece in pieces:
            choice, final = piece.choice, piece.final
            rid = choice.request_id
            echo = self.req.echo and rid not in self.echoed
            if not piece.text and final is None and not echo:
                continue
            self.echoed.add(rid)
            text, lp = self.part(choice, piece.text, piece.logprobs, self.offsets[rid], echo)
            self.offsets[rid] += len(text)
            chunks.append(CompletionResponse(id=self.gen.id, model=self.model_name, choices=[CompletionChoice(
                index=choice.index, text=text, logprobs=lp,
                finish_reason=final.finish_reason if final else None,
                stop_reason=final.stop_reason if final else None)]))
        return chunks

    def reply(self) -> dict:
        choices = []
        for c in self.gen.ordered():
            text, lp = self.part(c, c.text, c.logprobs, 0, self.req.echo)
            choices.append(CompletionChoice(index=c.index, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, prompt_logprobs=self.prompt_logprobs(c)))
        return CompletionResponse(id=self.gen.id, model=self.model_name, choices=choices,
                                  usage=self.gen.usage()).model_dump()
