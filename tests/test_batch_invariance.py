"""A row's logits do not depend on what else is in its step (issue 26), on the default dtype
(q8_0: NumbaOps("q8_0")): a decode row's logits are the same bits alone, among 1 to 99
other decode rows of other contexts, and beside prefill chunks of any size; a prompt's logits are
the same bits however it was chunked; and a seeded sampled request writes the same text alone and
among 16 others. float32 (OpenBLAS GEMMs, whose bits change with the row count) agrees only to
float32 rounding: the last test says how far."""

import numpy as np
import pytest

from engine_harness import Harness
from model.ops.numba_kernels import PARALLEL_WORK
from model.ops.numba_ops import NumbaOps
from model.ops.protocol import SampleBatch
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

BLOCK = 4
SPAN = 64  # blocks a request may use: 256 positions
OTHERS = 100  # requests besides the one watched


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Wide enough that 64 rows of its row-wise ops (norms, SiLU) cross PARALLEL_WORK while one
    row stays under it, so both twins of each kernel run (model/ops/numba_kernels.kernel)."""
    assert 64 * 512 >= PARALLEL_WORK > 1024
    return make_tiny_model(tmp_path_factory.mktemp("tiny-wide"), hidden=512, heads=8, kv_heads=2, intermediate=1024)


def runner_for(path, weights: str = "q8_0") -> ModelRunner:
    return ModelRunner.from_dir(path, num_blocks=SPAN * (OTHERS + 8), block_size=BLOCK, ops=NumbaOps(weights))


class Requests:
    """Prompts of assorted lengths, each request its own blocks, the others' prompts prefilled."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        rng = np.random.default_rng(1)
        vocab = runner.config.vocab_size
        self.prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 120, OTHERS + 1)]
        # request 0: a context short enough that its attention alone runs on one core
        self.watched = rng.integers(0, vocab, 30).tolist()
        assert (len(self.watched) + 1) * runner.config.num_heads * runner.config.head_dim < PARALLEL_WORK
        for i in range(1, OTHERS + 1):
            runner.logits(StepPlan([Row(i, self.prompts[i], 0, self.table(i))]))
        runner.logits(StepPlan([Row(0, self.watched, 0, self.table(0))]))

    @staticmethod
    def table(i: int) -> list[int]:
        return list(range(SPAN * i, SPAN * (i + 1)))

    def decode(self, i: int) -> Row:
        """Request i's next token (request 0's fixed; the others' positions are rewritten alike)."""
        prompt = self.watched if i == 0 else self.prompts[i]
        return Row(i, [11 + i], len(prompt), self.table(i), sample=True)

    def logits_of(self, rows: list[Row], i: int = 0) -> np.ndarray:
        """The logits of request i's row among rows (rows that sample only have them)."""
        sampling = [r.request_id for r in rows if r.sample]
        return np.asarray(self.runner.logits(StepPlan(rows)))[sampling.index(i)]


@pytest.fixture(scope="module")
def requests(wide_dir):
    return Requests(runner_for(wide_dir))


@pytest.mark.parametrize("others", [1, 2, 7, 16, 33, 64, 99])
def test_a_decode_rows_logits_are_the_same_bits_among_other_decode_rows(requests, others):
    alone = requests.logits_of([requests.decode(0)])
    rows = [requests.decode(i) for i in range(1, others + 1)]
    for at in (0, others // 2, others):  # first, in the middle, last
        got = requests.logits_of(rows[:at] + [requests.decode(0)] + rows[at:])
        np.testing.assert_array_equal(got, alone)


@pytest.mark.parametrize("sizes", [[1], [7], [64], [1, 7, 64], [100, 3]])
def test_a_decode_rows_logits_are_the_same_bits_beside_prefill_chunks(requests, sizes):
    """Prefill chunks of other requests (new prompts, and chunks on a cached prefix), with and
    without other decode rows."""
    alone = requests.logits_of([requests.decode(0)])
    rng = np.random.default_rng(len(sizes))
    chunks = [Row(f"p{j}", rng.integers(0, requests.runner.config.vocab_size, n).tolist(), 0 if j % 2 else 40, requests.table(OTHERS + 1 + j),
                  sample=j % 2 == 0) for j, n in enumerate(sizes)]
    for decoding in (0, 5):
        rows = [requests.decode(i) for i in range(1, decoding + 1)]
        got = requests.logits_of(chunks[:1] + rows + [requests.decode(0)] + chunks[1:])
        np.testing.assert_array_equal(got, alone)


@pytest.mark.parametrize("chunks", [[1] * 9 + [90], [7] * 14 + [1], [64, 35], [33, 1, 33, 32]])
def test_a_prompts_logits_are_the_same_bits_however_it_is_chunked(requests, chunks):
    """Whole, in chunks of any size (a one-token chunk goes the way of a decode row), beside
    other requests' decode rows: the last token's logits, then the first decode step's."""
    runner, prompt = requests.runner, (requests.prompts[0] + [5] * 99)[:99]
    assert sum(chunks) == len(prompt)
    spare = [OTHERS + 6, OTHERS + 7]

    def run(sizes, table, company):
        start, last = 0, None
        for n in sizes:
            row = Row("c", prompt[start:start + n], start, table, sample=start + n == len(prompt))
            rows = [requests.decode(i) for i in range(1, company + 1)] + [row]
            start += n
            last = requests.logits_of(rows, "c") if row.sample else runner.logits(StepPlan(rows))
        return last, requests.logits_of([Row("c", [3], len(prompt), table, sample=True)], "c")

    whole = run([len(prompt)], requests.table(spare[0]), 0)
    chunked = run(chunks, requests.table(spare[1]), 3)
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[1], whole[1])


def test_a_seeded_rows_draw_is_the_same_alone_and_among_others():
    """The sampler, on the same logits: a seeded row's token alone and among 199 others, through
    the batch kernel (its serial twin alone, the parallel one in the batch) and through NumPy's
    (a filtered row, its logprobs too)."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((200, 397), dtype=np.float32) * 3
    params = [SamplingParams(temperature=1.0, seed=r) if r % 2 else
              SamplingParams(temperature=0.9, top_k=40, seed=r, logprobs=3) for r in range(200)]
    history = [[1, 2, 3]] * 200
    ops = NumbaOps("q8_0")
    together = ops.sample(logits, SampleBatch(params, history, history, np.random.default_rng(0)))
    for r in (0, 1, 76, 77, 199):
        alone = ops.sample(logits[r:r + 1], SampleBatch(params[r:r + 1], history[:1], history[:1],
                                                        np.random.default_rng(0)))
        assert alone.token_ids[0] == together.token_ids[r]
        assert alone.logprobs[0] == together.logprobs[r] and alone.top_logprobs[0] == together.top_logprobs[r]


def test_a_seeded_request_writes_the_same_text_alone_and_among_16_others(wide_dir):
    """Temperature 1 and a seed, through the engine: alone, then submitted among 16 others (some
    seeded, some not, other temperatures) with a prefill budget that chunks every prompt
    differently."""
    tok = Tokenizer(wide_dir)
    prompt = tok.encode("The capital of France is Paris. The capital of Italy is")
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def generate(company: int, **config):
        h = Harness(runner_for(wide_dir), tok, **config)
        texts = [f"Numbers: {' '.join(map(str, range(i)))}" for i in range(company)]
        ids = [h.submit(tok.encode(t), max_tokens=24, ignore_eos=True,
                        sampling=SamplingParams(temperature=0.5 + i % 3 * 0.4, seed=i if i % 2 else None))
               for i, t in enumerate(texts[:company // 2])]
        watched = h.submit(prompt, max_tokens=24, ignore_eos=True, sampling=seeded)
        ids += [h.submit(tok.encode(t), max_tokens=24, ignore_eos=True) for t in texts[company // 2:]]
        h.run()
        assert all(len(h.tokens(i)) == 24 for i in ids)
        return h.tokens(watched), h.text(watched)

    alone = generate(0)
    assert len(alone[0]) == 24
    assert generate(16, prefill_chunk=13) == alone


def test_float32_logits_agree_alone_and_in_a_batch_only_to_rounding(wide_dir):
    """--dtype float32 multiplies through OpenBLAS, whose bits depend on the row count
    (FIELD-NOTES: a GEMV path at one row, kernel groups by row count with some core types), so a
    row's logits there agree alone and in a batch to float32 rounding, not bit for bit; making
    them exact would need GEMMs of fixed shapes."""
    requests = Requests(runner_for(wide_dir, "float32"))
    alone = requests.logits_of([requests.decode(0)])
    for others in (1, 33):
        got = requests.logits_of([requests.decode(i) for i in range(1, others + 1)] + [requests.decode(0)])
        np.testing.assert_allclose(got, alone, rtol=1e-4, atol=1e-4 * np.abs(alone).max())
