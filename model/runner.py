"""One call per engine step: a StepPlan in, one sampled token per sampling row out.

The engine owns which block ids a request holds; the runner owns the K/V memory behind them
and the model. This is the whole contract between app/engine and model/.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from model.compute import on_compute_thread
from model.config import ModelConfig
from model.errors import is_failure, one_line
from model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, StateRows
from model import rewind
from model.llama import Llama
from model.lora import Adapter, AdapterSlots
from model.ops.numpy_ops import NumpyOps
from model.ops.packed_logprobs import Fetch
from model.ops.protocol import Ops, SampleBatch, SampleResult
from model.sampling import SamplingParams
from model.weights import load_weights

GREEDY = SamplingParams(temperature=0.0)
AHEAD = -1  # a decode row's input token that the step before it, still running, is sampling
NO_TOKEN = -1  # a sampled "token" outside the vocabulary: logits with no finite value (cuda/sampling.cu)


@dataclass
class Row:
    """One request's share of a step: a prefill chunk or one decode token."""

    request_id: object
    token_ids: Sequence[int]
    start_pos: int  # position of token_ids[0]; positions before it are already cached
    block_table: Sequence[int]  # covers positions 0 .. start_pos + len(token_ids) - 1
    sample: bool = False  # sample after the last token (False for non-final prefill chunks)
    params: SamplingParams = GREEDY
    prompt_ids: Sequence[int] = ()  # for the repetition penalty
    output_ids: Sequence[int] = ()  # for penalties, and the seeded draw's token index
    mask: object = None  # a Future of the tokens allowed next (model.sampling.allowed_tokens' words), or None;
    # with guesses, of a list of them: one per sampled position
    embed: bool = False  # an embedding request's last chunk: its last token's state, pooled, not a token
    prompt_logprobs: int | None = None  # a prefill chunk whose prompt tokens are scored: each with its top n
    num_draft: int = 0  # a decode row's speculative guesses: its last num_draft tokens, each position sampled
    draft_limit: int = 0  # guesses the runner's draft model may add to this decode row (model/draft.py)
    state_slot: int | None = None  # a hybrid model's: where the request's delta-net state lives
    adapter: object = None  # its request's LoRA adapter (model/lora.AdapterUse), None for the base model

    def histories(self) -> list[Sequence[int]]:
        """The output before each sampled position: a verified guess is sampled as plain
        decoding would sample it there (penalties over it, a seeded draw at its index)."""
        drafts = list(self.token_ids[len(self.token_ids) - self.num_draft:])
        return [self.output_ids] + [[*self.output_ids, *drafts[:j]] for j in range(1, self.num_draft + 1)]


@dataclass
class StepPlan:
    rows: list[Row] = field(default_factory=list)


@dataclass
class Launched:
    """A step whose work is queued on the device; collect() waits for its sampled ids."""

    rows: list[Row]  # the sampling rows, in the order of ids
    fetch: Fetch  # the one download of the sampled ids (the logprobs after them) and the prompt logprobs
    sampled: SampleResult | None
    embedded: list = field(default_factory=list)  # a Sampled with its embedding for each embedding row
    scored: dict = field(default_factory=dict)  # request id -> (the prompt tokens its chunk scores, their Scored)
    failed: dict = field(default_factory=dict)  # request id -> why its row could not be sampled (its mask failed)
    rewinds: list = field(default_factory=list)  # a hybrid's rows with guesses (model/rewind.py)
    followed: tuple | None = None  # (the plan's rows, every token's final hidden state) for an MTP proposer


@dataclass
class Sampled:
    request_id: object
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    embedding: np.ndarray | None = None  # an embedding row's: its last token's final hidden state, unit length
    # a prompt_logprobs row's: per prompt token its chunk predicts, (token id, logprob, rank, top)
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
    error: str | None = None  # the row could not be sampled (token_id is NO_TOKEN): its request alone fails
    mirostat_mu: float | None = None  # a mirostat row's mu after this token, which its request keeps


def predicted(row: Row) -> Sequence[int]:
    """The prompt tokens a prompt_logprobs row's positions predict (each position's next),
    scored in its step; none for other rows."""
    if row.prompt_logprobs is None:
        return ()
    return row.prompt_ids[row.start_pos + 1:row.start_pos + len(row.token_ids) + 1]


@on_compute_thread
def load_model(model_dir: Path, ops: Ops | None = None, max_model_len: int | None = None,
               progress: bool | None = None) -> Llama:
    """The model on ops (NumpyOps when none), prepared layer by layer; progress as load_weights'."""
    config = ModelConfig.load(Path(model_dir))
    ops = ops or NumpyOps()
    weights = load_weights(Path(model_dir), config, ops.weight, progress, ops.asarray)
    ops.loaded()
    return Llama(config, weights, ops, max_model_len)


class ModelRunner:
    @on_compute_thread
    def __init__(self, config: ModelConfig, model: Llama, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, seed: int | None = None, state_slots: int = 1,
                 extra_layers: int = 0):
        """state_slots: a hybrid model's requests that may run at once (each holds one);
        extra_layers: K/V for layers beyond the model's (an MTP proposer's, model/mtp.py)."""
        self.config = config
        self.model = model
        self.ops = model.ops
        self.cache = KVCache(self.ops, config, num_blocks, block_size, state_slots, extra_layers)
        self.rng = np.random.default_rng(seed)
        self.graphs = None  # model.cuda_graphs.DecodeGraphs once captured
        # a device runs the steps: the engine may plan and launch the next before this one lands
        self.overlaps = self.ops.asynchronous
        self.swap = None  # model.swap.SwapPool on a GPU with --swap-space
        self.last_sampled = (None, {})  # the last launched step's ids on the device, and each request's row
        self.draft = None  # model.draft.DraftModel or model.mtp.MTP: guesses for rows with a draft_limit
        self.rewinds: list = []  # the last forward pass's rows with guesses, on a hybrid (model/rewind.py)
        self.adapters = None  # model.lora.AdapterSlots, where LoRA adapters are served
        # the position at which a prompt token's attention takes as long as the rest of it
        self.prefill_break_even = config.attention_break_even / self.ops.attention_cost

    @on_compute_thread
    def capture_graphs(self, max_seqs: int, max_model_len: int) -> None:
        """CUDA only: capture the decode graphs that logits() replays from now on."""
        from model.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.cache, max_seqs, max_model_len)

    @classmethod
    def from_dir(cls, model_dir: Path, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 ops: Ops | None = None, max_model_len: int | None = None, seed: int | None = None,
                 state_slots: int = 1, extra_layers: int = 0) -> "ModelRunner":
        model = load_model(model_dir, ops, max_model_len)
        return cls(model.config, model, num_blocks, block_size, seed, state_slots, extra_layers)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def state_slots(self) -> int:
        """A hybrid model's requests that may run at once; 0 for other models."""
        return self.cache.state_slots

    def logits(self, plan: StepPlan):
        """Run the forward pass; fp32 logits (sampling rows, vocab) on the ops device."""
        return self.forward(plan)[0]

    def forward(self, plan: StepPlan):
        """(fp32 logits of the sampling rows, then of every position of the prompt_logprobs rows
        that predicts a prompt token; the final hidden states of the embedding rows' last tokens,
        then of every token where the draft follows them (MTP), or None)."""
        self.rewinds = []
        follows = self.draft is not None and self.draft.wants_hidden
        adapted = self.adapters is not None and any(r.adapter is not None for r in plan.rows)
        if self.graphs is not None and not follows and not adapted and self.graphs.can_replay(plan):
            return self.graphs.replay(plan, self.fill_ahead), None
        ops, rows = self.ops, plan.rows
        query_lens = [len(r.token_ids) for r in rows]
        token_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in rows])
        positions = np.concatenate([np.arange(r.start_pos, r.start_pos + n) for r, n in zip(rows, query_lens)])
        slots = np.concatenate([self.cache.slots(r.block_table, r.start_pos, n) for r, n in zip(rows, query_lens)])
        ends = np.cumsum(query_lens) - 1
        starts = ends - np.asarray(query_lens) + 1
        scored = [start + k for r, start in zip(rows, starts) for k in range(len(predicted(r)))]
        sampled = [i for r, end in zip(rows, ends) if r.sample for i in range(end - r.num_draft, end + 1)]
        logit_index = np.array(sampled + scored, dtype=np.int64)
        pooled = [end for r, end in zip(rows, ends) if r.embed]
        pooled_index = np.array(pooled + (list(range(len(token_ids))) if follows else []), dtype=np.int64)
        meta = ops.attention_meta(query_lens, [r.start_pos + n for r, n in zip(rows, query_lens)],
                                  [r.block_table for r in rows], self.block_size)
        device_tokens = ops.asarray(token_ids, np.int64)
        self.fill_ahead(device_tokens, starts, rows)
        state_rows = self.state_rows(rows, starts) if self.config.delta_net else None
        self.rewinds = rewind.prepare(self.cache, rows, state_rows) if state_rows is not None else []
        out = self.model.forward(device_tokens, ops.asarray(positions, np.int64), ops.asarray(slots, np.int32), meta,
                                 self.cache, ops.asarray(logit_index, np.int64),
                                 ops.asarray(pooled_index, np.int64) if pooled_index.size else None, state_rows,
                                 self.adapters.step([r.adapter for r in rows], query_lens) if adapted else None)
        return out if pooled_index.size else (out, None)

    @on_compute_thread
    def serve_adapters(self, slots: int, max_rank: int) -> None:
        """Room for `slots` LoRA adapters of rank up to max_rank (model/lora.py)."""
        self.adapters = AdapterSlots(self.config, self.ops, slots, max_rank)

    @on_compute_thread
    def load_adapter(self, adapter: Adapter, slot: int) -> None:
        """The adapter into a slot (whatever it held before), between steps."""
        self.adapters.load(adapter, slot)

    def state_rows(self, rows: list[Row], starts) -> StateRows:
        """Where each row's delta-net state lives; a row at position 0 starts from zeros."""
        for r in rows:
            if r.state_slot is None or not 0 <= r.state_slot < self.cache.state_slots:
                raise ValueError(f"row {r.request_id!r} of a hybrid model needs a state slot below"
                                 f" {self.cache.state_slots} (it has {r.state_slot})")
        slots = np.array([r.state_slot for r in rows], dtype=np.int64)
        if len(set(slots.tolist())) < len(rows):
            raise ValueError("two rows of one step share a state slot")
        return StateRows(np.asarray(starts, np.int64), np.array([len(r.token_ids) for r in rows], np.int64), slots,
                         np.array([r.start_pos == 0 for r in rows]))

    def fill_ahead(self, device_tokens, starts, rows) -> None:
        """Rows whose input is AHEAD take the token the step before sampled for their request,
        device to device: starts[i] is where row i's tokens begin in device_tokens."""
        ahead = [(start, self.last_sampled[1][r.request_id]) for start, r in zip(starts, rows)
                 if r.token_ids[0] == AHEAD]
        if ahead:
            at, source = np.array(ahead, dtype=np.int64).T
            device_tokens[self.ops.asarray(at, np.int64)] = self.last_sampled[0][self.ops.asarray(source, np.int64)]

    @on_compute_thread
    def launch(self, plan: StepPlan) -> Launched:
        """Queue the step on the device: forward pass, sampling, and the copy of the sampled ids
        to the host. On the CPU the work is done when this returns."""
        if self.draft is not None:
            self.draft.propose(plan.rows)
        rows = [r for r in plan.rows if r.sample]
        # one entry per sampled position: a row with guesses has one for each, and one after them
        sampling = [r for r in rows for _ in range(r.num_draft + 1)]
        logits, hidden = self.forward(plan)  # the masks are computed meanwhile
        embeds = [r for r in plan.rows if r.embed]
        embedded = self.embeddings(embeds, hidden[:len(embeds)]) if embeds else []
        followed = (plan.rows, hidden[len(embeds):]) if self.draft is not None and self.draft.wants_hidden else None
        scored = self.score_prompts(plan.rows, logits[len(sampling):])
        scores = [s.packed.device for _, s in scored.values() if s.packed is not None]  # prompt logprobs on the device
        if not sampling:
            return Launched([], Fetch(self.ops, scores), None, embedded, scored, followed=followed)
        histories = [h for r in rows for h in (r.histories() if r.num_draft else [self.history(r)])]
        failed: dict = {}
        masks = [m for r in rows for m in self.masks(r, failed)]
        sampled = self.ops.sample(logits[:len(sampling)], SampleBatch(
            [r.params for r in sampling], [r.prompt_ids for r in sampling], histories,
            self.rng, keys=[r.request_id for r in sampling], masks=masks))
        self.last_sampled = (sampled.token_ids, {r.request_id: i for i, r in enumerate(sampling)})
        ids = sampled.token_ids if sampled.packed is None else sampled.packed.device  # the ids, and logprobs
        return Launched(sampling, Fetch(self.ops, [ids, *scores]), sampled, embedded, scored, failed, self.rewinds,
                        followed)

    @staticmethod
    def masks(row: Row, failed: dict) -> list:
        """The row's mask for each position it samples (a row with guesses has a list of them).
        A mask that could not be computed (its grammar raised, or panicked) fails its row alone:
        the row samples unmasked, its token is dropped, and failed says why."""
        if row.mask is None:
            return [None] * (row.num_draft + 1)
        try:
            return row.mask.result() if row.num_draft else [row.mask.result()]
        except BaseException as e:
            if not is_failure(e):
                raise
            failed[row.request_id] = f"the output format failed: {type(e).__name__}: {one_line(e)}"
            return [None] * (row.num_draft + 1)

    def score_prompts(self, rows: list[Row], logits) -> dict:
        """Each prompt_logprobs row's predicted prompt tokens and their Scored under the logits
        of the positions before them (one logits row per such position, in forward's order)."""
        scored, at = {}, 0
        for row in rows:
            targets = predicted(row)
            if not len(targets):
                continue
            scored[row.request_id] = targets, self.ops.score(logits[at:at + len(targets)], targets,
                                                             row.prompt_logprobs)
            at += len(targets)
        return scored

    def embeddings(self, rows: list[Row], hidden) -> list[Sampled]:
        """Each embedding row's final hidden state as a unit vector (last-token pooling, as
        Qwen3-Embedding and vLLM's default for decoder models pool)."""
        h = self.ops.to_host(hidden).astype(np.float64)
        h /= np.maximum(np.linalg.norm(h, axis=1, keepdims=True), 1e-12)
        return [Sampled(r.request_id, NO_TOKEN, embedding=h[i].astype(np.float32)) for i, r in enumerate(rows)]

    @staticmethod
    def history(row: Row):
        """The output so far as the sampler counts it: a row fed AHEAD has one token more than
        the engine knows yet. Only penalties and seeded draws read it (and then only its
        length, unless a slot must be refilled), so only they pay for the copy."""
        if row.token_ids[0] != AHEAD or not (row.params.penalized or row.params.seed is not None):
            return row.output_ids
        return [*row.output_ids, AHEAD]

    @on_compute_thread
    def collect(self, launched: Launched) -> list[Sampled]:
        """Wait for a launched step's sampled ids; an id outside the vocabulary comes back as
        NO_TOKEN, which fails that row's request alone (app/engine/outputs.py)."""
        out, fetched = launched.embedded, launched.fetch.parts()
        ids = fetched.pop(0) if launched.rows else []
        if launched.rows and launched.sampled.packed is not None:
            ids = launched.sampled.packed.arrived(ids)
        for (_, s), host in zip([v for v in launched.scored.values() if v[1].packed is not None], fetched):
            s.packed.arrived(host)
        scored = {rid: [(int(t), lp, rank, top) for t, lp, rank, top in zip(targets, s.logprobs, s.ranks,
                                                                               s.top_logprobs)]
                  for rid, (targets, s) in launched.scored.items()}
        if launched.followed is not None:  # the MTP layer's K/V, and its guesses for the next step
            self.draft.follow(*launched.followed, [NO_TOKEN if r.request_id in launched.failed else i
                                                   for r, i in zip(launched.rows, ids)])
        if launched.rows:
            sampled, vocab = launched.sampled, self.config.vocab_size
            failed = launched.failed
            if launched.rewinds:
                rewind.apply(self.model, self.cache, launched.rewinds, self.guessed_ids(launched.rows, ids))
            out = [Sampled(r.request_id, int(ids[i]) if 0 <= ids[i] < vocab and r.request_id not in failed
                           else NO_TOKEN, sampled.logprobs[i], sampled.top_logprobs[i],
                           prompt_logprobs=scored.pop(r.request_id, None), error=failed.get(r.request_id),
                           mirostat_mu=sampled.mirostat_mu[i] if sampled.mirostat_mu else None)
                   for i, r in enumerate(launched.rows)] + out
        return out + [Sampled(rid, NO_TOKEN, prompt_logprobs=lps) for rid, lps in scored.items()]

    @staticmethod
    def guessed_ids(rows: list[Row], ids) -> list[list[int]]:
        """The ids each row with guesses sampled, in order (rows: one entry per sampled position)."""
        out, at = [], 0
        while at < len(rows):
            n = rows[at].num_draft + 1
            if n > 1:
                out.append([int(i) for i in ids[at:at + n]])
            at += n
        return out

    @on_compute_thread
    def step(self, plan: StepPlan) -> list[Sampled]:
        return self.collect(self.launch(plan))

    def release(self, request_id) -> None:
        """The request has ended: the sampler and the draft may drop what they kept for it."""
        self.ops.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    @on_compute_thread
    def reserve_swap(self, num_blocks: int) -> None:
        """A GPU's spill pool: num_blocks slots of pinned host memory, allocated now
        (model/swap.py). Without one, a spill is a fresh host array (the CPU's K/V is on the host
        already)."""
        from model.swap import SwapPool

        self.swap = SwapPool(self.cache, num_blocks)

    @on_compute_thread
    def save_state(self, slot: int):
        """A hybrid's delta-net state in slot, copied to the host (a spill)."""
        return self.cache.save_state(slot)

    @on_compute_thread
    def load_state(self, slot: int, state) -> None:
        self.cache.load_state(slot, state)

    @on_compute_thread
    def save_blocks(self, block_ids):
        return self.swap.save(block_ids) if self.swap else self.cache.save_blocks(block_ids)

    @on_compute_thread
    def load_blocks(self, block_ids, data) -> None:
        (self.swap.load if self.swap else self.cache.load_blocks)(block_ids, data)

    @on_compute_thread
    def drop_spill(self, data) -> None:
        """A spill's host copy is no longer needed (reloaded, or its request ended)."""
        if self.swap:
            self.swap.release(data)
