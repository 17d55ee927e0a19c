"""Logprobs computed on the device and fetched with the sampled ids, in the one download a step
already makes (issue 51): never the logits, and no wait of their own.

One int32 device array holds, in order: the sampled ids (rows), each row's logprob of its id
(rows, float32 bits), its top ids (rows x n) and their logprobs (rows x n, float32 bits), with n
the most any row asks. cuda/logprobs.cu writes the last three parts, the sampler the first (or,
for prompt logprobs, the ranks). The runner downloads the step's arrays together (Fetch), where
it would download the ids, and hands each host copy back (arrived); the logprobs are read from
it. A caller that reads them first (a test calling ops.sample) gets a download of its own then.
"""

from typing import Sequence

import numpy as np

ROW_THREADS = 256  # logprobs.cu: a multiple of 32


class PackedLogprobs:
    def __init__(self, ops, rows: int, wanted: Sequence[int | None]):
        """wanted: each row's top n, or None where the row asks no logprobs."""
        self.ops, self.rows, self.wanted = ops, rows, list(wanted)
        self.n = max(1, max(n or 0 for n in self.wanted))
        self.device = ops.zeros(rows * (2 + 2 * self.n), np.int32)
        self.host = None
        self.read: tuple[list, list, list] | None = None  # (logprobs, top logprobs, ids), once read
        self.logprobs, self.top_logprobs, self.ranks = Unpacked(self, 0), Unpacked(self, 1), Unpacked(self, 2)

    def parts(self, array):
        """array's views: (ids, chosen logprobs, top ids (rows, n), top logprobs (rows, n))."""
        rows, n = self.rows, self.n
        top = array[2 * rows:].reshape(2, rows, n)
        return array[:rows], array[rows:2 * rows].view(np.float32), top[0], top[1].view(np.float32)

    @property
    def ids(self):
        """The sampled ids' place on the device: the sampler writes them here."""
        return self.device[:self.rows]

    def compute(self, logits, ids=None) -> None:
        """The logprobs kernel over logits, of ids (the sampled ones where None)."""
        _, chosen, top_ids, top_values = self.parts(self.device)
        vocab = logits.shape[1]
        self.ops.kernel("logprobs.cu", "logprobs")((self.rows,), (ROW_THREADS,), (
            chosen, top_ids, top_values, logits, self.ids if ids is None else ids,
            self.ops.asarray([n or 0 for n in self.wanted], np.int32), np.int32(vocab), np.int32(self.n)))

    def arrived(self, host: np.ndarray) -> np.ndarray:
        """The host copy of device (the step's download); its ids."""
        self.host = host
        return host[:self.rows]

    def unpack(self) -> tuple[list, list, list]:
        if self.read is None:
            host = self.host if self.host is not None else self.ops.to_host(self.device)
            ids, chosen, top_ids, top_values = self.parts(host)
            self.read = ([None if n is None else float(chosen[r]) for r, n in enumerate(self.wanted)],
                         [None if n is None else [(int(top_ids[r, k]), float(top_values[r, k])) for k in range(n)]
                          for r, n in enumerate(self.wanted)], [int(i) for i in ids])
        return self.read


class Unpacked(Sequence):
    """SampleResult.logprobs (part 0) or .top_logprobs (part 1), or Scored's (and its ranks, the
    ids' part: 2), read from the host copy when first indexed."""

    def __init__(self, packed: PackedLogprobs, part: int):
        self.packed, self.part = packed, part

    def __len__(self) -> int:
        return self.packed.rows

    def __getitem__(self, i):
        return self.packed.unpack()[self.part][i]


class Fetch:
    """Device arrays brought to the host by one download (joined on the device where there are
    several), handed back as their host parts in order."""

    def __init__(self, ops, arrays: list):
        self.sizes = [int(a.size) for a in arrays]
        joined = arrays[0] if len(arrays) == 1 else ops.xp.concatenate(arrays) if arrays else None
        self.download = None if joined is None else ops.download(joined)

    def parts(self) -> list[np.ndarray]:
        if self.download is None:
            return []
        return np.split(self.download.result(), np.cumsum(self.sizes)[:-1])
