"""Sampling on the device: penalties, the draw and logprobs for a whole batch, with the token
counts the penalties need kept on the device per request.

A request that asks for penalties holds a slot: one row of output counts and one of
prompt-seen flags, filled once from its history when it first samples, then updated on the
device by count_tokens after every step (nothing is rebuilt from the history). The engine
releases the slot when the request ends. The slot also records how many output tokens it has
counted: a row whose history no longer matches (a step that failed after sampling) is refilled.

What crosses to the device per step is small host data (each row's parameters, uniforms and
bias entries); what comes back is the sampled ids, and logprobs only when a row asks, in the same
download (model/ops/packed_logprobs.py).

A row that asks for a sampler the kernels do not do (SamplingParams.extended: typical-p,
dynamic temperature, XTC, DRY, mirostat 2, allowed_token_ids, bad_words, a penalty window) is drawn on the host
by the NumPy reference (numpy_sampling.sample_rows) from its downloaded logits, and its id
replaces the kernel's; its logprobs (of the raw logits) are the kernel's as for any row.
"""

import numpy as np

from model.ops.numpy_sampling import sample_rows
from model.ops.packed_logprobs import PackedLogprobs
from model.ops.protocol import SampleBatch, SampleResult, Scored
from model.sampling import allowed_tokens

SAMPLE_THREADS = 1024  # sampling.cu: a power of two, at most 1024
ROW_THREADS = 256  # penalties.cu


class DeviceSampler:
    def __init__(self, ops):
        self.ops, self.xp = ops, ops.xp
        self.counts = self.seen = None  # (slots, vocab): int32 output counts, uint8 prompt-seen
        self.slots: dict = {}  # key -> slot
        self.counted: dict = {}  # key -> output tokens its slot has counted
        self.free: list[int] = []
        self.fills = 0  # slots filled from a history: once per penalized request, unless a step failed

    def release(self, key) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            del self.counted[key]
            self.free.append(slot)

    def _slot(self, key, vocab: int, prompt, output) -> int:
        """The key's slot, filled from the history when new or out of step with it."""
        slot = self.slots.get(key)
        if slot is None:
            if not self.free:
                self._grow(vocab)
            slot = self.slots[key] = self.free.pop()
        elif self.counted[key] == len(output):
            return slot
        history = np.asarray(output, dtype=np.int64)
        history = history[history >= 0]  # not runner.AHEAD: a refill never meets one while its step runs
        counts = np.bincount(history, minlength=vocab).astype(np.int32)
        seen = np.zeros(vocab, dtype=np.uint8)
        seen[np.asarray(prompt, dtype=np.int64)] = 1
        self.counts[slot] = self.xp.asarray(counts)
        self.seen[slot] = self.xp.asarray(seen)
        self.counted[key] = len(output)
        self.fills += 1
        return slot

    def _grow(self, vocab: int) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old)
        counts, seen = self.xp.zeros((new, vocab), dtype=np.int32), self.xp.zeros((new, vocab), dtype=np.uint8)
        if old:
            counts[:old], seen[:old] = self.counts, self.seen
        self.counts, self.seen = counts, seen
        self.free.extend(range(new - 1, old - 1, -1))

    def sample(self, logits, batch: SampleBatch) -> SampleResult:
        """NumpyOps.sample's contract on device logits (rows, vocab) fp32. batch.keys name each
        row's request, so its counts persist across steps; without keys every slot is temporary.
        batch.masks: a grammar's allowed tokens per row, or None; uploaded as one bool per token."""
        ops, xp = self.ops, self.xp
        params, prompts, outputs, masks = batch.params, batch.prompts, batch.outputs, batch.masks
        rows, vocab = logits.shape
        temporary = batch.keys is None
        keys = [object() for _ in params] if temporary else batch.keys
        on_host = [r for r, p in enumerate(params) if p.extended]
        count_rows = np.array([self._slot(k, vocab, prompts[r], outputs[r]) if p.penalized and not p.extended else -1
                               for r, (k, p) in enumerate(zip(keys, params))], dtype=np.int32)
        device_rows = ops.asarray(count_rows, np.int32)
        adjusted = logits
        if masks and any(m is not None for m in masks):  # a new array: logprobs are of the raw logits
            allowed = np.ones((rows, vocab), dtype=bool)
            for r, mask in enumerate(masks):
                if mask is not None:
                    allowed[r] = allowed_tokens(mask, vocab)
            adjusted = xp.where(ops.asarray(allowed, bool), logits, np.float32(-np.inf))
        if any(p.penalized or p.logit_bias for p in params):
            if adjusted is logits:  # penalties work in place; logprobs are of the raw distribution
                adjusted = logits.copy()
            offsets = np.cumsum([0] + [len(p.logit_bias) for p in params])
            ops.kernel("penalties.cu", "apply_penalties")((rows,), (ROW_THREADS,), (
                adjusted, self._table(self.counts, np.int32), self._table(self.seen, np.uint8), device_rows,
                ops.asarray([p.repetition_penalty for p in params], np.float32),
                ops.asarray([p.presence_penalty for p in params], np.float32),
                ops.asarray([p.frequency_penalty for p in params], np.float32), ops.asarray(offsets, np.int32),
                ops.asarray([t for p in params for t in p.logit_bias] or [0], np.int32),
                ops.asarray([v for p in params for v in p.logit_bias.values()] or [0], np.float32), np.int32(vocab)))
        uniform = [0.0 if r in on_host else batch.uniform(r) for r in range(rows)]  # the host draws its own
        wanted = [p.logprobs for p in params]
        packed = None if all(n is None for n in wanted) else PackedLogprobs(ops, rows, wanted)
        ids = ops.zeros(rows, np.int32) if packed is None else packed.ids  # fetched with the logprobs, if any
        ops.kernel("sampling.cu", "sample")((rows,), (SAMPLE_THREADS,), (
            ids, adjusted, ops.asarray([p.temperature for p in params], np.float32),
            ops.asarray([min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params], np.int32),
            ops.asarray([p.top_p for p in params], np.float32), ops.asarray([p.min_p for p in params], np.float32),
            ops.asarray([p.top_n_sigma for p in params], np.float32), ops.asarray(uniform, np.float32),
            np.int32(vocab)))
        mus: list = [None] * rows
        if on_host:
            host_logits = ops.to_host(logits[ops.asarray(on_host, np.int64)])
            drawn = sample_rows(host_logits, batch.take(on_host))
            drawn.token_ids[~np.isfinite(host_logits).any(axis=1)] = -1  # no finite logit: no token, as the kernel's
            ids[ops.asarray(on_host, np.int64)] = ops.asarray(drawn.token_ids, np.int32)
            for i, r in enumerate(on_host):
                mus[r] = drawn.mirostat_mu[i]
        if (count_rows >= 0).any():
            ops.kernel("penalties.cu", "count_tokens")((-(-rows // 32),), (32,), (
                self.counts, device_rows, ids, np.int32(rows), np.int32(vocab)))
            for k, slot in zip(keys, count_rows):
                if slot >= 0:
                    self.counted[k] += 1
        if temporary:
            for k in keys:
                self.release(k)
        if packed is None:
            return SampleResult(ids, [None] * rows, [None] * rows, mus)
        packed.compute(logits)  # of the raw logits
        return SampleResult(ids, packed.logprobs, packed.top_logprobs, mus, packed=packed)

    def score(self, logits, token_ids, top: int) -> Scored:
        """NumpyOps.score's contract on device logits: the logprobs kernel, and each rank
        counted on the device (the raw logits order the tokens as their logprobs do) into the
        ids' part of the packed array: the step's one download brings them (runner.collect)."""
        rows = logits.shape[0]
        ids = self.ops.asarray(np.asarray(token_ids), np.int32)
        packed = PackedLogprobs(self.ops, rows, [top] * rows)
        packed.compute(logits, ids)
        chosen = logits[self.xp.arange(rows), ids]
        packed.ids[...] = 1 + (logits > chosen[:, None]).sum(axis=1)
        return Scored(packed.logprobs, packed.ranks, packed.top_logprobs, packed=packed)

    def _table(self, table, dtype):
        """The counts (or seen) table, or a one-element stand-in when no slot exists yet."""
        return table if table is not None else self.ops.zeros(1, dtype)
