"""A model's own multi-token-prediction layer as speculative decoding's proposer
(--speculative-config method "mtp", as vLLM names it; Qwen3.5 ships one, mtp.* in a checkpoint,
the nextn block after the layers in a GGUF).

The layer reads what the model just computed: at position p, the final hidden state h_p and the
token at p + 1 go in (each normalised, side by side through fc), one full-attention decoder
layer runs over them, and the model's LM head reads out a guess for the token at p + 2. Its K/V
is one more attention layer of the model's cache (index num_layers), under the same block
tables, so a spill carries it and a recompute rebuilds it, as it does the model's own.

So the guesses for a row come from the step before it: once a step's tokens are sampled, the
layer runs over every position whose next token is now known (a prompt chunk's, a decode row's
kept guesses and the token after them), and each row that will decode gets its guesses by
feeding the layer its own output and its last guess, num_speculative_tokens times. The next
row of that request starts where they were made for, and carries them (Row.draft_limit of
them) into the model's step, which verifies them as it verifies any guess.
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from model.compute import on_compute_thread
from model.config import ModelConfig
from model.errors import ModelError
from model.runner import Row
from model.weights import LayerWeights, LayerReader, open_tensors, prepared

# a checkpoint's names (vLLM's Qwen3_5MultiTokenPredictor); a GGUF's map to them (model/gguf/names.py)
FC, EMBED_NORM, HIDDEN_NORM, NORM = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                                     "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
LAYER = "mtp.layers.0."


@dataclass
class MTPWeights:
    fc: object  # (hidden, 2 x hidden): the normalised embedding's columns, then the hidden state's
    embed_norm: object  # (hidden,)
    hidden_norm: object  # (hidden,)
    norm: object  # (hidden,): the layer's output, normalised before the LM head
    layer: LayerWeights  # a full-attention decoder layer (with the model's experts, for a mixture)


def layer_config(config: ModelConfig) -> ModelConfig:
    """The model's config with the MTP layer after its layers: full attention, and experts
    where the model routes to them."""
    linear = None if config.linear_layers is None else (*config.linear_layers, False)
    moe = None if config.moe_layers is None else (*config.moe_layers, config.num_experts > 0)
    return replace(config, num_layers=config.num_layers + 1, linear_layers=linear, moe_layers=moe)


def load_mtp_weights(model_dir: Path, config: ModelConfig, prepare, keep_float) -> MTPWeights:
    """The MTP layer's weights, prepared as the model's are (ops.weight, ops.asarray); one line
    when the checkpoint has none."""
    L, H = config.num_layers, config.hidden_size
    with open_tensors(model_dir) as tensors:
        if FC not in tensors.entries:
            raise ModelError(f"{model_dir} has no multi-token-prediction layer (mtp.* tensors, or a GGUF's nextn"
                             " block); speculate with the ngram method instead")
        for name in [n for n in tensors.entries if n.startswith(LAYER)]:  # read as layer L of the model
            tensors.entries[f"model.layers.{L}.{name[len(LAYER):]}"] = tensors.entries[name]
        reader = LayerReader(tensors, model_dir, layer_config(config))
        layer = prepared(reader.layer(L), prepare, keep_float)
        return MTPWeights(prepare(reader.take(FC, (H, 2 * H))), *(prepare(reader.norm(n, (H,))) for n in
                                                                   (EMBED_NORM, HIDDEN_NORM, NORM)), layer)


class MTP:
    wants_hidden = True  # the runner hands follow() the step's final hidden states

    def __init__(self, runner, weights: MTPWeights, count: int):
        """count: the guesses made for each row that will decode (num_speculative_tokens)."""
        self.runner, self.w, self.count = runner, weights, count
        self.index = runner.config.num_layers  # the layer's K/V in the model's cache
        self.guesses: dict[object, tuple[int, list[int]]] = {}  # request id -> (its next row's start, guesses)

    @classmethod
    @on_compute_thread  # packing the weights runs parallel kernels: on the thread the steps run on
    def load(cls, model_dir: Path, runner, count: int, weights: MTPWeights | None = None) -> "MTP":
        """runner's cache must hold the layer's K/V (ModelRunner's extra_layers=1); weights:
        load_weights', where they were loaded before the KV cache was sized, else loaded now."""
        if len(runner.cache.k) <= runner.config.num_layers:
            raise ValueError("the model runner's cache has no room for the MTP layer's K/V (extra_layers=1)")
        return cls(runner, weights or cls.load_weights(model_dir, runner.model), count)

    @staticmethod
    @on_compute_thread
    def load_weights(model_dir: Path, model) -> MTPWeights:
        """The layer's weights on the model's device: loaded before the KV cache is sized, the
        memory plan measures them with the model's (model/memory.py)."""
        return load_mtp_weights(Path(model_dir), model.config, model.ops.weight, model.ops.asarray)

    def propose(self, rows: list[Row]) -> None:
        """Before the model's step: each row the planner lets guess takes the guesses made for
        where it starts (none when the request moved on another way since)."""
        for row in rows:
            at, made = self.guesses.get(row.request_id, (None, ()))
            if row.draft_limit > 0 and not row.num_draft and at == row.start_pos and made:
                take = list(made[:row.draft_limit])
                row.token_ids, row.num_draft = [row.token_ids[0], *take], len(take)

    def follow(self, rows: list[Row], hidden, ids) -> None:
        """After the model's step: rows its plan's (in token order), hidden the final hidden
        state of each of the step's tokens, ids the sampled ids (one per sampled position, in
        the sampling rows' order). The layer's K/V is written for every position whose next
        token is now known, then each row that will decode gets its guesses."""
        feed, at, sampled = [], 0, 0  # (row, the tokens its positions are followed by, its first token's index)
        for row in rows:
            n = len(row.token_ids)
            if row.sample:
                mine = [int(i) for i in ids[sampled:sampled + row.num_draft + 1]]
                sampled += row.num_draft + 1
                guesses = list(row.token_ids[n - row.num_draft:])
                kept = next((j for j, g in enumerate(guesses) if mine[j] != g), row.num_draft)
                if 0 <= mine[kept] < self.runner.config.vocab_size and not row.embed:
                    feed.append((row, [*row.token_ids[1:n - row.num_draft + kept], mine[kept]], at))
            elif not row.embed:
                history = [*row.prompt_ids, *row.output_ids]
                following = history[row.start_pos + 1:row.start_pos + n + 1]
                if len(following) == n:
                    feed.append((row, following, at))
            at += n
        if not feed:
            return
        ops = self.runner.ops
        step = [Row(row.request_id, nexts, row.start_pos, row.block_table, sample=self.decodes(row))
                for row, nexts, _ in feed]
        index = np.concatenate([np.arange(first, first + len(nexts)) for _, nexts, first in feed])
        guessed, outputs = self.run(step, hidden[ops.asarray(index, np.int64)])
        going = [r for r in step if r.sample]
        made = {r.request_id: [] for r in going}
        for r in going:
            self.guesses[r.request_id] = (r.start_pos + len(r.token_ids), made[r.request_id])
        while going:  # each guess fed back with the layer's output before it, for the next
            for r, token in zip(going, guessed):
                made[r.request_id].append(int(token))
            ahead = [i for i, r in enumerate(going) if len(made[r.request_id]) < self.count and self.covers(r)]
            going = [Row(r.request_id, [made[r.request_id][-1]], r.start_pos + len(r.token_ids), r.block_table,
                         sample=True) for r in (going[i] for i in ahead)]
            if going:
                guessed, outputs = self.run(going, outputs[ops.asarray(np.array(ahead, np.int64), np.int64)])

    def decodes(self, row: Row) -> bool:
        """Whether the row's request decodes next and may guess: a decode row let guess this
        step (one paused, or never let guess, costs no LM head), or a prompt's last chunk."""
        return row.sample and not row.embed and (row.draft_limit > 0 or len(row.token_ids) > 1 + row.num_draft)

    def covers(self, row: Row) -> bool:
        """Whether row's block table holds the position after its last token (a further guess)."""
        return row.start_pos + len(row.token_ids) < len(row.block_table) * self.runner.block_size

    def run(self, rows: list[Row], hidden):
        """The layer over rows (the tokens that follow each position) and the hidden states of
        those positions: K/V written; (the argmax guess of each sampling row's last position, the
        layer's normalised output there, which the next guess feeds on)."""
        runner, ops = self.runner, self.runner.ops
        lens = [len(r.token_ids) for r in rows]
        tokens = np.concatenate([np.asarray(r.token_ids, np.int64) for r in rows])
        positions = np.concatenate([np.arange(r.start_pos, r.start_pos + n) for r, n in zip(rows, lens)])
        slots = np.concatenate([runner.cache.slots(r.block_table, r.start_pos, n) for r, n in zip(rows, lens)])
        ends = np.cumsum(lens) - 1
        last = np.array([end for r, end in zip(rows, ends) if r.sample], np.int64)
        meta = ops.attention_meta(lens, [r.start_pos + n for r, n in zip(rows, lens)], [r.block_table for r in rows],
                                  runner.block_size)
        at = ops.asarray(last, np.int64) if last.size else None
        logits, out = self.forward(ops.asarray(tokens, np.int64), hidden, ops.asarray(positions, np.int64),
                                   ops.asarray(slots, np.int32), meta, at)
        return ([] if logits is None else ops.to_host(ops.xp.argmax(logits, axis=-1))), out  # ids only come back

    def forward(self, token_ids, hidden, positions, slots, meta, last):
        """(fp32 logits at last, the layer's normalised output at last); (None, None) with no
        last, once the K/V is written."""
        model, ops, w = self.runner.model, self.runner.ops, self.w
        c = model.config
        eps = c.rms_norm_eps
        e = ops.rms_norm(ops.embedding(model.w.embed, token_ids, model.embed_scale), w.embed_norm, eps)
        x = ops.linear(ops.xp.concatenate([e, ops.rms_norm(hidden, w.hidden_norm, eps)], axis=1), w.fc)
        x = ops.xp.ascontiguousarray(x)  # the residual stream, as the embedding starts it
        x, h = ops.add_rms_norm(x, None, w.layer.attn_norm, eps)
        cos, sin = model.tables["global"]
        attn = model.attention(h, w.layer, self.index, cos[positions], sin[positions], slots, meta, self.runner.cache,
                               temperature=None, window=0)
        if last is None:
            return None, None
        x, h = ops.add_rms_norm(x, attn, w.layer.mlp_norm, eps)
        _, out = ops.add_rms_norm(x[last], model.mlp(h[last], w.layer), w.norm, eps)  # no K/V after attention
        return ops.logits(out, model.w.lm_head, c.final_softcap), out

    def release(self, request_id) -> None:
        self.guesses.pop(request_id, None)
