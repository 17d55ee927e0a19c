"""Speculative decoding's proposals: what a decoding row offers the model to check, and how many.
The planner plans its decode rows, then hands them here (add_guesses) before it plans prefill;
the engine gives a grammar's row with guesses a mask for each position (outputs.guess_masks).

A proposer guesses the next tokens of a request; its decode row then carries them after its
last token, the step computes logits at every one of those positions, and the engine keeps the
guesses the model itself samples, plus the one token after them (outputs.accept's order: stops,
max_tokens and aborts land on the token they would have without speculation). A verified token
is sampled exactly as plain decoding samples it (greedy's argmax, a seeded row's draw keyed by
its token index), so the text is the same with speculation on or off, and an unseeded row's
tokens keep the model's distribution: a guess is kept only when the model's own draw equals it.

NgramProposer is prompt lookup (vLLM's "ngram", llama.cpp's lookup decoding): the longest
suffix of the request's tokens, prompt_lookup_max down to prompt_lookup_min long, that occurred
before, and the tokens that followed its latest occurrence. Speculation keeps each request's
count adaptive: a guess fully kept asks for more next time, a partly kept one for what was
kept plus one, and two misses in a row pause the request's guessing, longer each time until a
guess is kept again.
"""

import json
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from app.engine.block_tables import BlockTables
from app.engine.request import Request
from model.runner import AHEAD, Row

METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config keys: method "ngram" (prompt lookup), "draft_model" (model:
    a smaller model with the same tokenizer, model/draft.py) or "mtp" (the model's own
    multi-token-prediction layer, model/mtp.py: one guess a row unless num_speculative_tokens
    says more, as vLLM defaults to the layers the checkpoint has)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    @classmethod
    def parse(cls, text: str | None, draft_model: str | None = None) -> "SpeculativeConfig":
        """--speculative-config's JSON, with --draft-model's path as its "model" (a ValueError
        of one line for anything else)."""
        try:
            given = json.loads(text) if text else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--speculative-config must be a JSON object, such as"
                             ' {"method": "ngram", "num_speculative_tokens": 4}')
        if draft_model is not None:
            given["model"] = draft_model
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"--speculative-config has unknown keys {sorted(unknown)}; it takes"
                             f" {sorted(cls.__dataclass_fields__)}")
        if "model" in given and "method" not in given:
            given["method"] = "draft_model"
        if given.get("method") == "mtp":
            given.setdefault("num_speculative_tokens", 1)
        config = cls(**given)
        if config.method not in METHODS:
            raise ValueError(f"--speculative-config method {config.method!r} is not supported; Spool has"
                             f" {', '.join(map(repr, METHODS))}")
        if (config.method == "draft_model") != isinstance(config.model, str):
            raise ValueError("--speculative-config takes a draft \"model\" (a path or Hub id) with method"
                             " \"draft_model\", and only then")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config {name} must be a positive integer, got {value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("--speculative-config prompt_lookup_min is over prompt_lookup_max")
        return config


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of tokens' longest suffix
        (lookup_max down to lookup_min long): the latest with k tokens after it, else the
        latest (a run of one token repeating overlaps the end); none when none occurred.
        Vectorised: about 0.7 ms a row for a 10,000-token context on the 2-core machine."""
        ids = np.asarray(tokens)
        for n in range(min(self.lookup_max, len(tokens) - 1), self.lookup_min - 1, -1):
            windows = sliding_window_view(ids[:-1], n)  # every start but the suffix's own
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if starts.size:
                whole = starts[starts + n + k <= len(tokens)]
                start = int(whole[-1] if whole.size else starts[-1])
                return tokens[start + n:start + n + k]
        return []


@dataclass
class Pace:
    """One request's guess count, following what it kept."""

    k: int
    misses: int = 0
    pause: int = 16  # tokens the next pause lasts: doubled by each pause until a guess is kept
    paused_until: int = 0  # the request's output length at which guessing resumes


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: rows that carried guesses, guesses, guesses kept, and kept
    by position (the first guess of a row, the second, ...)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)


class Speculation:
    PAUSES = (16, 256)  # tokens a request decodes plainly after two rows in a row kept no guess:
    # the first pause, doubled by each pause until a guess is kept, and the longest

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # prompt lookup guesses here; a draft model's or an MTP layer's are the runner's (model/draft.py, mtp.py)
        self.lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.paces: dict[str, Pace] = {}
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def add_guesses(self, planned: list[tuple[Request, Row]], tables: BlockTables, spare: int) -> None:
        """Each decode row may carry guesses: prompt lookup's, made here, or room for a draft
        model's, which the runner makes (Row.draft_limit). They take blocks free now (a guess
        never preempts) within spare, the step's tokens left. A grammar's row guesses by lookup
        only (the engine masks each position). Not for a row fed ahead, one under a thinking
        budget, penalties or mirostat (one mu a step), or one whose stop tokens min_tokens
        still bans."""
        for request, row in planned:
            p = request.params
            if (spare <= 0 or row.token_ids[0] == AHEAD or p.sampling.penalized or p.sampling.mirostat
                    or len(request.output_ids) < p.min_tokens
                    or request.constrained and not (self.lookup and p.thinking is None)):
                continue
            count = self.allowance(request, min(spare, request.max_tokens - len(request.output_ids) - 1))
            guesses = self.lookup.propose(request.all_ids, count) if self.lookup and count else []
            count = len(guesses) if self.lookup else count
            if count and not tables.grow(request, request.num_tokens - 1 + count):  # the last guess's position
                count = tables.covered(request) - request.num_tokens
            if count:
                if self.lookup:
                    row.token_ids, row.num_draft = [row.token_ids[0], *guesses[:count]], count
                else:
                    row.draft_limit = count
                row.block_table = tables.table(request)
                spare -= count

    def allowance(self, request, limit: int) -> int:
        """How many guesses request's next row may carry, at most limit: its pace, or none
        while paused."""
        pace = self.paces.setdefault(request.id, Pace(self.config.num_speculative_tokens))
        if len(request.output_ids) < pace.paused_until:
            return 0
        return max(0, min(pace.k, limit))

    def verified(self, request, proposed: int, kept: int) -> None:
        """A row with proposed guesses landed and kept the first `kept` of them."""
        if not proposed:
            return
        s = self.stats
        s.drafts += 1
        s.draft_tokens += proposed
        s.accepted_tokens += kept
        for position in range(kept):
            s.accepted_per_pos[position] += 1
        pace = self.paces.get(request.id)
        if pace is None:
            return
        if kept:
            pace.k = min(pace.k + 2, self.config.num_speculative_tokens) if kept == proposed else kept + 1
            pace.misses, pace.pause = 0, self.PAUSES[0]
        else:
            pace.k, pace.misses = 1, pace.misses + 1
            if pace.misses >= 2:
                pace.paused_until, pace.misses = len(request.output_ids) + pace.pause, 0
                pace.pause = min(2 * pace.pause, self.PAUSES[1])

    def release(self, request_id) -> None:
        self.paces.pop(request_id, None)
