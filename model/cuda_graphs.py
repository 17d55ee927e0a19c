"""Decode steps replayed from CUDA graphs, one per padded batch size, as vLLM and SGLang do.

Launching a decode step's few hundred kernels from Python costs more than the GPU takes to run
them on a small model. Once every input of a decode step lives in fixed device buffers (token
ids, positions, K/V slots, context lengths, block tables), its kernels depend only on the batch
size. So at start-up the forward pass is captured once per size of `graph_sizes` (1, 2, 4, 8 ...
and max_seqs), the largest first, all sizes reading a prefix of the same buffers. A step packs
its rows into one pinned host array, copies it up in one transfer, and replays the smallest graph
that holds its rows. The copy (the fields, and the block tables of the graph's rows only) is queued, and reads the host array when it runs, so steps take
turns with two host arrays and wait for a turn's last copy before filling it again: with the
overlapped loop, the next step is filled while the device may not yet have run this one's copy.
Padding rows write no K/V (slot -1), attend to one token, and their logits are never read.
Every graph writes its logits into a prefix of one fp32 buffer of max_seqs rows (a graph's
output is a view of it; replays take turns, each step's sampling queued before the next replay):
at 256 rows of a 128k vocabulary, a buffer per graph held about 2.2 GB, this one 131 MB, and
model/memory.py counts it before the KV cache takes its share.

What differs from an eager step: the decode attention's partials hold the model's whole split
count (ops/decode_attention.decode_splits) rather than what the step's longest context needs, and
its blocks a split set follow the padded batch size; a row splits by its own length either way,
and a part's partial does not depend on the block that computes it, so its logits are the same
bits. Sampling runs
eagerly, after the replay, on the graph's logits. Prefill and mixed steps run eagerly. A graph is
valid while the weights and the KV cache arrays stay where they were at capture, which they do
for the runner's lifetime.
"""

import numpy as np

from model.ops.cuda_ops import AttentionMeta

MAX_PADDING = 8  # above this, sizes go up in steps of 8 rather than doubling


def logits_bytes(max_seqs: int, vocab: int) -> int:
    """The decode graphs' one logits buffer: fp32, a row per sequence."""
    return max_seqs * vocab * 4


def graph_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_seqs: a step pads by at
    most 7 rows."""
    sizes = [s for s in (1, 2, 4) if s < max_seqs]
    sizes += list(range(MAX_PADDING, max_seqs, MAX_PADDING))
    return sizes + [max_seqs]


class DecodeGraphs:
    """The captured graphs of one runner, and the buffers they read."""

    FIELDS = ("token_ids", "positions", "slots", "context_lens")

    def __init__(self, model, cache, max_seqs: int, max_model_len: int):
        self.model, self.cache, self.ops = model, cache, model.ops
        self.sizes = graph_sizes(max_seqs)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // cache.block_size)  # block table columns
        rows = self.sizes[-1]
        launcher = self.ops.launcher
        self.hosts = [launcher.pinned((len(self.FIELDS) + self.width) * rows, np.int32) for _ in range(2)]
        self.uploads = [None, None]  # the event after each host array's last copy up
        self.turn = 0  # the host array the last fill wrote
        self.filled = [rows, rows]  # per host array, the rows whose block tables may hold ids
        self.device = self.ops.zeros(self.hosts[0].shape, np.int32)
        self.fields = {name: self.device[i * rows:(i + 1) * rows] for i, name in enumerate(self.FIELDS)}
        self.block_tables = self.device[len(self.FIELDS) * rows:].reshape(rows, self.width)
        self.logit_index = self.ops.asarray(np.arange(rows), np.int64)
        self.logits = self.ops.zeros((rows, model.w.lm_head.shape[0]), np.float32)  # every graph's, outside their pool
        self.replays = 0
        self.fill([])
        self.upload()
        self.graphs = {size: launcher.capture(lambda size=size: self.forward(size)) for size in reversed(self.sizes)}

    def forward(self, size: int):
        """The decode forward pass of the first `size` rows of the buffers; what each graph holds."""
        f = self.fields
        meta = AttentionMeta(decode=True, query_lens=[1] * size, query_starts=None,
                             context_lens=f["context_lens"][:size], block_tables=self.block_tables[:size],
                             max_context=self.max_model_len)
        return self.model.forward(f["token_ids"][:size], f["positions"][:size], f["slots"][:size], meta, self.cache,
                                  self.logit_index[:size], logits_out=self.logits[:size])

    def can_replay(self, plan) -> bool:
        """Every row decodes one token and samples, and a graph holds them all."""
        return 0 < len(plan.rows) <= self.sizes[-1] and all(
            len(r.token_ids) == 1 and r.sample and len(r.block_table) <= self.width for r in plan.rows)

    def padded_size(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    @property
    def host(self) -> np.ndarray:
        """The host array the last fill wrote."""
        return self.hosts[self.turn]

    def fill(self, rows) -> None:
        """Pack rows into the other host array, once its last copy up has run; every row after
        them is padding."""
        self.turn = 1 - self.turn
        if self.uploads[self.turn] is not None:
            self.uploads[self.turn].synchronize()
        n, most, block_size = len(rows), self.sizes[-1], self.cache.block_size
        fields = self.host[:len(self.FIELDS) * most].reshape(len(self.FIELDS), most)
        tables = self.host[len(self.FIELDS) * most:].reshape(most, self.width)
        fields[:, n:] = 0
        fields[2, n:] = -1  # padding writes no K/V
        fields[3, n:] = 1  # and attends to one token
        tables[:max(n, self.filled[self.turn])] = 0
        for i, row in enumerate(rows):
            position, table = row.start_pos, row.block_table
            fields[0, i] = row.token_ids[0]
            fields[1, i] = position
            fields[2, i] = table[position // block_size] * block_size + position % block_size
            fields[3, i] = position + 1
            tables[i, :len(table)] = table
        self.filled[self.turn] = n

    def upload(self, size: int | None = None) -> None:
        """The last fill's host array into the device buffers, queued on the step's stream: the
        fields, and the block tables of the first `size` rows (all when None), which are all a
        graph of that size reads (a whole table set is megabytes at a long context)."""
        launcher, fields = self.ops.launcher, len(self.FIELDS) * self.sizes[-1]
        end = fields + (self.sizes[-1] if size is None else size) * self.width
        launcher.upload(self.device[:fields], self.host[:fields])
        self.uploads[self.turn] = launcher.upload(self.device[fields:end], self.host[fields:end])

    def replay(self, plan, fill_ahead):
        """The step's logits (rows, vocab), fp32, from the smallest graph that holds its rows.
        fill_ahead (ModelRunner's) puts the tokens of rows fed AHEAD in place on the device."""
        rows, size = plan.rows, self.padded_size(len(plan.rows))
        self.fill(rows)
        self.upload(size)
        fill_ahead(self.fields["token_ids"], range(len(rows)), rows)
        graph = self.graphs[size]
        graph.replay()
        self.replays += 1
        return graph.output[:len(rows)]
