"""Perplexity of a model on a text, measured as llama.cpp's llama-perplexity measures it: the
text's tokens cut into windows of --ctx, each read as one prompt from an empty cache, and the
second half of each window scored, so that every scored token has at least ctx / 2 before it.
Prints exp(mean negative log-likelihood) with its standard error over the scored tokens.

    python tools/perplexity.py [--model DIR|FILE.gguf] [--dtype auto|float32|q8_0] [--cache-type f16|q8_0]
                               [--ctx 512] [--text FILE]

The default text is Python's reference chapter on compound statements (prose with some code,
shipped with Python, as tests/test_q8.py reads it). Comparing two runs on one text is what the
figure is for: a quantization's cost against float32, one GGUF type against another, q8_0 K/V
(--cache-type, as `spool serve --cache-type-k q8_0 --cache-type-v q8_0` keeps them) against f16.

--simulate-kv (on --backend numpy, float32 weights and activations) rounds each K and V head
vector as a device's cache would hold it, as it is written: bfloat16, or fp8_e4m3 as CUDA's
--kv-cache-dtype fp8 keeps it (x / s to the nearest even e4m3 value, saturating at 448, s = max
|x| / 448 per token and head: cuda/kv_write.cu), times s again. The kernels' own cost needs a GPU
(the CPU harness runs them, far too slowly for a model this size): this is the rounding's.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model  # noqa: E402, F401  (first: it sets the thread pools' environment before NumPy loads)
import numpy as np  # noqa: E402

from model.backend import resolve  # noqa: E402
from model.choices import KV_CACHE_TYPES  # noqa: E402
from model.default import resolve_model  # noqa: E402
from model.runner import ModelRunner, Row, StepPlan  # noqa: E402


def window_logprobs(runner: ModelRunner, window: list[int]) -> np.ndarray:
    """The log-probability of each of window's tokens after the first, given those before it:
    the window as one prompt whose tokens are scored (a prompt_logprobs row)."""
    table = list(range(runner.num_blocks))
    row = Row("window", window[:-1], 0, table, prompt_ids=window, prompt_logprobs=0)
    logits = np.asarray(runner.ops.to_host(runner.logits(StepPlan([row]))), dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    normalizer = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return logits[np.arange(len(window) - 1), window[1:]] - normalizer


def perplexity(runner: ModelRunner, ids: list[int], ctx: int) -> tuple[float, float, int]:
    """(perplexity, its standard error, tokens scored) over every whole window of ctx tokens."""
    scored = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        scored.append(window_logprobs(runner, ids[start:start + ctx])[ctx // 2 - 1:])
    nll = -np.concatenate(scored)
    mean, error = nll.mean(), nll.std(ddof=1) / math.sqrt(len(nll))
    return float(np.exp(mean)), float(np.exp(mean) * error), len(nll)


def e4m3_rounded(x: np.ndarray) -> np.ndarray:
    """float32 x to the nearest e4m3 value (ties to even, 2^-9 apart below 2^-6), saturating at 448."""
    a = np.abs(x).astype(np.float64)
    _, ex = np.frexp(a)
    quantum = np.where(a >= 2.0 ** -6, np.ldexp(1.0, ex - 4), 2.0 ** -9)
    return (np.sign(x) * np.minimum(np.rint(a / quantum) * quantum, 448.0)).astype(np.float32)


def simulated(kind: str):
    """NumpyOps whose K/V writes round each head vector as kind keeps it (see the docstring)."""
    from model.ops.dtypes import to_float32, to_storage
    from model.ops.numpy_ops import NumpyOps

    def rounded(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if kind == "bfloat16":
            return to_float32(to_storage(x, "bfloat16"), "bfloat16")
        s = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(448)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(s > 0, e4m3_rounded(np.where(s > 0, x / s, 0).astype(np.float32)) * s, x)

    class Simulated(NumpyOps):
        def write_kv(self, cache_k, cache_v, slots, k, v) -> None:
            super().write_kv(cache_k, cache_v, slots, rounded(k), rounded(v))

    return Simulated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="cpu", choices=("cpu", "numpy"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "q8_0"), help="weights on --backend cpu")
    parser.add_argument("--cache-type", default="f16", choices=KV_CACHE_TYPES,
                        help="the K/V cache's type on --backend cpu (default: f16)")
    parser.add_argument("--simulate-kv", default=None, choices=("bfloat16", "fp8_e4m3"),
                        help="on --backend numpy: K/V rounded as a device's cache keeps them (see above)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens a window holds (default: 512)")
    parser.add_argument("--text", default=None, help="a UTF-8 text file (default: Python's 'compound' chapter)")
    args = parser.parse_args()
    if args.ctx < 4 or args.ctx % 2:
        parser.error("--ctx must be an even number of at least 4")

    from model.tokenizer import Tokenizer

    if args.text:
        text = Path(args.text).read_text(encoding="utf-8")
    else:
        from pydoc_data.topics import topics
        text = topics["compound"]
    model_dir = resolve_model(args.model)
    ids = Tokenizer(model_dir).encode(text)
    if len(ids) < args.ctx:
        parser.error(f"the text is {len(ids)} tokens, less than one window of --ctx {args.ctx}")
    if args.simulate_kv and args.backend != "numpy":
        parser.error("--simulate-kv rounds the numpy backend's K/V; add --backend numpy")
    try:
        backend = resolve(args.backend, args.dtype, args.cache_type)
    except ValueError as e:
        parser.error(str(e))
    if args.simulate_kv:
        backend.ops = simulated(args.simulate_kv)
    loaded = backend.load(model_dir)
    runner = ModelRunner(loaded.config, loaded, num_blocks=-(-args.ctx // 16) + 1, seed=0)
    value, error, count = perplexity(runner, ids, args.ctx)
    kv = f"{args.simulate_kv} (simulated)" if args.simulate_kv else args.cache_type
    print(f"# model {model_dir.name}, backend {backend.name} ({backend.dtype}, K/V {kv}),"
          f" {len(ids)} tokens, windows of {args.ctx}")
    print(f"perplexity {value:.4f} +/- {error:.4f} over {count} tokens")


if __name__ == "__main__":
    main()
