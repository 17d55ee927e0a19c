"""A hybrid model's delta-net state under speculation: a row that verifies k guesses runs all of
them through its state, but the state must end up as if only the tokens the model kept had been
fed. Before such a row runs, its slot's state is copied aside and its fused input projections
are kept per delta-net layer as the forward pass makes them; once the sampled ids say how many
guesses were kept, a row that rejected some gets the copy back and its kept tokens replayed
through the convolution and the recurrence alone (no GEMM: their inputs are the ones kept), in
the same order and arithmetic as plain decoding, so the state has the bits it would have had."""

from dataclasses import dataclass, field

import numpy as np

from model.kv_cache import StateRows


@dataclass
class Rewind:
    row: int  # the row's index in its step
    slot: int
    guesses: list[int]
    before: list  # KVCache.save_state of the slot before the row ran
    inputs: list = field(default_factory=list)  # (layer, the row's fused input projections), as the layers ran


def prepare(cache, rows, state_rows: StateRows) -> list[Rewind]:
    """A Rewind for each row with guesses, its state copied aside; state_rows keeps their inputs."""
    rewinds = [Rewind(i, r.state_slot, list(r.token_ids[len(r.token_ids) - r.num_draft:]),
                      cache.save_state(r.state_slot)) for i, r in enumerate(rows) if r.num_draft]
    state_rows.inputs = {w.row: w.inputs for w in rewinds} or None
    return rewinds


def apply(model, cache, rewinds: list[Rewind], sampled: list[list[int]]) -> None:
    """sampled: per rewind, the ids its row's positions sampled. A row that kept fewer guesses
    than it carried gets its state back and replays the input token and the guesses it kept."""
    c = model.config
    for w, ids in zip(rewinds, sampled):
        kept = next((j for j, guess in enumerate(w.guesses) if ids[j] != guess), len(w.guesses))
        if kept == len(w.guesses):
            continue
        cache.load_state(w.slot, w.before)
        rows = StateRows(np.zeros(1, np.int64), np.array([kept + 1], np.int64), np.array([w.slot], np.int64),
                         np.zeros(1, bool))
        for layer, proj in w.inputs:
            model.ops.gated_delta_net(proj[:kept + 1], model.w.layers[layer].delta_net, c.delta_net,
                                      cache.conv[layer], cache.recurrent[layer], rows, c.rms_norm_eps)
