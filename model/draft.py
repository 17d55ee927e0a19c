"""A draft model's guesses for speculative decoding (--speculative-config method "draft_model").

The draft is a smaller model with the target's tokenizer, run by its own ModelRunner over a KV
cache of the target's block count and size, indexed by the same block tables: a block id means
the same positions in both caches. Every step mirrors the target's writes into the draft's
cache (prefill chunks, decode tokens), so a prefix-cache hit in the target is one in the draft,
and a row the planner lets guess (Row.draft_limit) gets that many guesses, the draft's greedy
tokens one after another, before the target's forward pass verifies them.

What the draft has computed for a request is `computed` positions, trusted only below the row's
start position: a guess the target rejected sits at or past the next row's start, and is fed
again. A request whose block table changed under it (a spill reloaded into other blocks) is
recomputed from its first token.
"""

from pathlib import Path

import numpy as np

from model.config import ModelConfig
from model.errors import ModelError
from model.runner import ModelRunner, Row, StepPlan
from model.tokenizer import Tokenizer


class DraftModel:
    wants_hidden = False  # guesses before the step, from the draft's own forward (MTP's come after)

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.computed: dict[object, int] = {}  # request id -> positions the draft's cache holds
        self.tables: dict[object, list[int]] = {}  # request id -> the block table those were written in

    @staticmethod
    def load_model(backend, model_dir: Path, target: ModelConfig, tokenizer: Tokenizer):
        """The draft's weights on the target's backend, loaded before the KV cache is sized so the
        memory plan measures them (model/memory.py); refused in one line when its vocabulary is
        not the target's (its guesses would be other tokens)."""
        if Tokenizer(model_dir).hf.get_vocab() != tokenizer.hf.get_vocab():
            raise ModelError(f"the draft model {model_dir} has another tokenizer than the model; a draft must"
                             " share its vocabulary")
        if target.kv_window:
            raise ModelError("a draft model needs a model whose layers keep their whole context (this one frees"
                             " the blocks behind its sliding window); use the ngram method")
        return backend.load(model_dir)

    @classmethod
    def load(cls, backend, model_dir: Path, target: ModelRunner, tokenizer: Tokenizer) -> "DraftModel":
        return cls.over(cls.load_model(backend, model_dir, target.config, tokenizer), target)

    @classmethod
    def over(cls, draft, target: ModelRunner) -> "DraftModel":
        """The draft model (a Llama) over a cache of the target's blocks."""
        return cls(ModelRunner(draft.config, draft, target.num_blocks, target.block_size))

    def propose(self, rows: list[Row]) -> None:
        """Mirror the step's writes into the draft's cache and fill in the guesses of the rows
        with a draft_limit: their token_ids become [last, guess...] and num_draft the count."""
        first, guessing = [], []
        for row in rows:
            start = self.trusted(row)
            end = row.start_pos + len(row.token_ids)  # the positions the target writes this step
            if row.num_draft or start >= end:
                continue
            history = [*row.prompt_ids, *row.output_ids]
            tokens = row.token_ids if start == row.start_pos else history[start:end]
            first.append(Row(row.request_id, tokens, start, row.block_table, sample=row.draft_limit > 0))
            if row.draft_limit > 0:
                guessing.append(row)
            self.computed[row.request_id] = end
        guesses = {row.request_id: [] for row in guessing}
        step = first
        while step:  # the mirrored writes with each guessing row's first guess, then one guess a pass
            logits = self.runner.logits(StepPlan(step))
            ops = self.runner.ops  # the argmax on the device: only the ids come back, never the logits
            ids = ops.to_host(ops.xp.argmax(logits, axis=-1)) if guessing else []
            for r, token in zip([r for r in step if r.sample], ids):
                guesses[r.request_id].append(int(token))
            step = []
            for row in guessing:
                made = guesses[row.request_id]
                if len(made) < row.draft_limit:  # feed the last guess, for the next one
                    position = row.start_pos + len(made)
                    step.append(Row(row.request_id, [made[-1]], position, row.block_table, sample=True))
                    self.computed[row.request_id] = position + 1
        for row in guessing:
            row.token_ids = [row.token_ids[0], *guesses[row.request_id]]
            row.num_draft = len(guesses[row.request_id])

    def trusted(self, row: Row) -> int:
        """The first position the draft must compute for this row. A new request's first row
        starts past its prefix-cache hits, which the draft mirrored when they were written; a
        cache past the row's start is never trusted, nor one in a block table that changed
        (a spill reloaded elsewhere). Trusting too much costs only guesses, never tokens: the
        target verifies every one."""
        rid, table = row.request_id, list(row.block_table)
        held = self.tables.get(rid)
        self.tables[rid] = table
        if held is None:
            self.computed[rid] = row.start_pos
        elif table[:len(held)] != held[:len(table)]:
            self.computed[rid] = 0
        return min(self.computed[rid], row.start_pos)

    def release(self, request_id) -> None:
        self.computed.pop(request_id, None)
        self.tables.pop(request_id, None)
