"""What each sampled token means for its request: grammar, stops, text, thinking budgets, frames.
It never chooses which request runs; the engine asks it what each planned row samples with
(prepare: its params and, for a constrained row, a Future of its mask). It alone writes a
request's OutputState, and appends to its output_ids.

The ends it finds (a stop, the length, a grammar error, a client gone) it returns, for the
engine to hand to the planner; the final frame goes out in close(), once the request is retired.
"""

from dataclasses import dataclass, replace

from app.engine.errors import RequestFault
from app.engine.grammar import Grammars
from app.engine.request import Frame, OutputState, Request
from app.engine.stats import Stats
from app.engine.stops import StopMatcher
from model.runner import AHEAD, NO_TOKEN, Row, Sampled, StepPlan
from model.tokenizer import IncrementalDetokenizer

BAN = float("-inf")  # how min_tokens holds back the stops: they cannot be sampled at all


@dataclass
class Ending:
    reason: str  # stop | length | error (cancelled is the planner's, or send()'s)
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer, stats: Stats):
        self.tokenizer = tokenizer
        self.stats = stats
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.grammars = Grammars(tokenizer)

    def open(self, request: Request) -> None:
        """A request's detokenizer, stop-string buffer and grammar matcher, at submission."""
        grammar = request.params.grammar
        request.output = OutputState(IncrementalDetokenizer(self.tokenizer, request.prompt_ids),
                                     StopMatcher(request.params.stop),
                                     None if grammar is None else self.grammars.matcher(grammar))

    # -- what a row samples with ------------------------------------------------------------------

    def prepare(self, request: Request, row: Row) -> None:
        """A planned row's sampling params and, when it samples under a grammar or a thinking
        budget, the Future of its mask (of one mask per position, for a row with guesses)."""
        row.params = self.sampling_params(request, row.token_ids[0] == AHEAD)
        if row.sample and request.constrained:
            row.mask = self.guess_masks(request, row.token_ids[1:]) if row.num_draft else self.mask(request)

    @staticmethod
    def settle(plan: StepPlan) -> None:
        """Wait for a failed step's masks, so no matcher is still in use when its request ends."""
        for row in plan.rows:
            if row.mask is not None:
                row.mask.exception()  # waits; the mask's own error, if any, is the step's

    def sampling_params(self, request: Request, ahead: bool = False):
        """min_tokens: until it is reached, the stop tokens are banned outright. ahead: the row
        samples one token past the output the host has."""
        p = request.params
        sampling = p.sampling
        if len(request.output_ids) + ahead < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
            if banned:
                sampling = replace(sampling, logit_bias={**sampling.logit_bias, **{t: BAN for t in banned}})
        if sampling.mirostat:  # its state travels with the row, so a preempted request resumes it
            sampling = replace(sampling, mirostat_mu=request.output.mirostat_mu)
        return sampling

    def mask(self, request: Request):
        """A Future of a constrained request's mask, computed on the grammars' thread while the
        step's forward pass runs (the runner waits for it only to sample). Its matcher is the
        thread's until then: accept() and a failed step come after."""
        return self.grammars.later(self.mask_now, request)

    def guess_masks(self, request: Request, guesses: list[int]):
        """A Future of the masks of a row with guesses, one per sampled position: its grammar's
        after each guess, as far as the grammar takes them (a position past a guess it refuses
        is never kept, as the model cannot sample that guess; it gets the last mask). Only a
        grammar's mask follows guesses: the planner gives none to a row under a thinking budget."""
        return self.grammars.later(self.masks_along, request, guesses)

    def masks_along(self, request: Request, guesses: list[int]) -> list:
        matcher = request.output.matcher
        masks = [self.grammars.mask(matcher)]
        valid = matcher.validate_tokens(guesses)
        for token in guesses[:valid]:
            matcher.consume_token(token)
            masks.append(self.grammars.mask(matcher))
        if valid:
            matcher.rollback(valid)
        return masks + [masks[-1]] * (len(guesses) - valid)

    def mask_now(self, request: Request):
        """The tokens allowed next: one, when a thinking budget is spent; else what its grammar
        allows; None when nothing constrains it."""
        forced = self.thinking_end(request)
        if forced is not None:
            return self.grammars.only(forced)
        matcher = request.output.matcher
        return None if matcher is None else self.grammars.mask(matcher)

    @staticmethod
    def thinking_end(request: Request) -> int | None:
        """The next token of the thinking's end tags, once the budget is spent and until they are written."""
        budget, out, state = request.params.thinking, request.output_ids, request.output
        if budget is None or state.thought:
            return None
        start, end, close = budget.start_ids, budget.end_ids, budget.close_ids
        if out[:len(start)] != list(start[:len(out)]):
            state.thought = True  # the model answered without thinking
            return None
        thought = len(out) - len(start)
        if thought < 0:
            return None
        if (len(out) >= len(end) and tuple(out[-len(end):]) == end
                or close and len(close) <= thought <= budget.max_tokens and tuple(out[-len(close):]) == close):
            state.thought = True
            return None
        if thought < budget.max_tokens:
            return None
        written = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or tuple(out[-k:]) == end[:k])
        return end[written]

    # -- results ------------------------------------------------------------------------------

    @staticmethod
    def score_prompt(request: Request, sampled: Sampled) -> None:
        """A prefill chunk's prompt logprobs, in order; they go out with the request's next frame."""
        request.output.pending_prompt_logprobs += sampled.prompt_logprobs

    def accept(self, request: Request, sampled: Sampled, now: float) -> Ending | None:
        """One new token: the grammar, the stop checks, the detokenizer and the stop-string
        buffer. Returns how the request ends, when this token ends it."""
        p, state = request.params, request.output
        if p.embed:  # its prompt is read: the vector is the whole answer
            state.embedding = sampled.embedding
            return Ending("stop")
        if sampled.error is not None:
            return Ending("error", error=sampled.error)
        token = sampled.token_id
        if token == NO_TOKEN:
            s = p.sampling
            if p.grammar is not None or s.allowed_token_ids is not None or s.bad_words or s.logit_bias:
                return Ending("error", error=RequestFault(
                    "no token is left to sample: the request's grammar, allowed_token_ids, bad_words and"
                    " logit_bias together exclude every token"))
            return Ending("error", error="the model gave no token: its logits held no finite value")
        if state.matcher is not None and not state.matcher.consume_token(token):
            return Ending("error", error=f"the grammar refused token {token}: {state.matcher.get_error()}")
        request.output_ids.append(token)
        state.pending_ids.append(token)
        if sampled.mirostat_mu is not None:
            state.mirostat_mu = sampled.mirostat_mu
        if p.sampling.logprobs is not None:
            state.pending_logprobs.append((token, sampled.logprob, sampled.top_logprobs))
        self.stats.token(request, now)
        state.first_token_at = state.first_token_at or now
        state.last_token_at = now
        may_stop = len(request.output_ids) > p.min_tokens
        if may_stop and token in self.eos_ids and not p.ignore_eos:
            return self.end_naturally(request, "stop")
        if may_stop and token in p.stop_token_ids:
            return self.end_naturally(request, "stop", token)
        text = state.detok.add(token)
        stop = None
        if may_stop:
            text, stop = state.stops.feed(text)
        state.pending_text += text
        if stop is not None:
            return Ending("stop", stop)
        if state.matcher is not None and state.matcher.is_stopped():  # the grammar is complete
            return self.end_naturally(request, "stop")
        if len(request.output_ids) >= request.max_tokens:
            return self.end_naturally(request, "length")
        return None

    @staticmethod
    def end_naturally(request: Request, reason: str, stop_token: int | None = None) -> Ending:
        """An end no stop string made: the text held back for one is released first."""
        state = request.output
        state.pending_text += state.stops.feed(state.detok.flush())[0] + state.stops.take_held()
        return Ending(reason, stop_token)

    def send_deltas(self, requests) -> list[Request]:
        """The text and tokens not sent yet; returns the requests whose client cannot take them
        (a full or closed channel: it cannot keep up, or has left)."""
        return [r for r in requests if (r.output.pending_ids or r.output.pending_text) and not self.send(r)]

    def close(self, request: Request, now: float) -> None:
        """A retired request: counted, and its final frame sent."""
        self.stats.request_done(request, now)
        self.send(request, final=True)

    def send(self, request: Request, final: bool = False) -> bool:
        state, end = request.output, request.schedule
        frame = Frame(request.id, state.pending_text, state.pending_ids,
                      state.pending_logprobs if request.params.sampling.logprobs is not None else None,
                      prompt_logprobs=state.pending_prompt_logprobs or None)
        if final:
            frame.finish_reason, frame.stop_reason = end.finish_reason, end.stop_reason
            frame.usage, frame.error, frame.embedding = request.usage(), end.error, state.embedding
        state.pending_text, state.pending_ids, state.pending_logprobs = "", [], []
        state.pending_prompt_logprobs = []
        try:
            request.emit(frame)
        except Exception:  # a final frame that cannot go out has no one to go to
            return False
        return True
