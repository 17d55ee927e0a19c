"""Model-only throughput on the CPU backend: prefill of one 512-token prompt, and decode steps at
batch 1, 8, 32 and 64 (no scheduler, no HTTP).

    python tools/bench_model.py [--model DIR|FILE.gguf] [--backend cpu|numpy] [--dtype float32|q8_0] [--context 256] [--steps 16]
    python tools/bench_model.py --model FILE.gguf --prompt-tokens 16384 --prefill-chunk 512 --prefill-repeats 1 --batches ""

Each decode row has its own prompt of --context tokens already in the cache, so attention reads
real K/V. Times are the median over repeats after one warm-up step. The header gives the bytes a
decode token reads (every weight but the embedding table, which only the tied LM head reads
whole) and this machine's memory-copy bandwidth (NumPy copying 128 MiB, read plus write), so
batch 1 can be read as a share of the speed the bandwidth allows.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model  # noqa: E402, F401  (first: it sets the thread pools' environment before NumPy loads)
import numpy as np  # noqa: E402

from model.backend import resolve  # noqa: E402
from model.lora import AdapterUse  # noqa: E402
from model.default import resolve_model  # noqa: E402
from model.runner import ModelRunner, Row, StepPlan  # noqa: E402

TEXT = ("Spool is a small inference server. It batches requests, pages the KV cache, and streams "
        "tokens over HTTP and WebSocket. The quick brown fox jumps over the lazy dog. ") * 64


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        return ", ".join(f"{p['internal_api']} {p.get('version')} {p.get('architecture')} x{p['num_threads']}"
                         for p in pools)
    except ImportError:
        return f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}"


def copy_bandwidth(nbytes: int = 128 << 20, repeats: int = 5) -> float:
    """Bytes per second np.copyto moves (each byte read once and written once), the best of repeats.
    Run before the model loads, its buffers freed, so that a peak RSS measured around this
    tool is the model's (they are far larger than any cache, and far smaller than a model)."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def bytes_per_token(model) -> int:
    """What one decode token reads of the weights: all of them, less an untied embedding table
    (and Gemma 4's per-layer one: a row a token), and of a mixture's experts only the top k it
    is routed to."""
    w = model.w
    unread = sum((e.gate_up.nbytes + e.down.nbytes) * (1 - e.top_k / e.count)
                 for e in (layer.experts for layer in w.layers) if e is not None)
    unread += w.per_layer.table.nbytes if w.per_layer is not None else 0
    return int(model.weight_bytes - (w.embed.nbytes if w.lm_head is not w.embed else 0) - unread)


def random_adapter(config, rank: int):
    """A LoRA adapter of rank `rank` on every dense projection, random (its speed is what counts)."""
    from model.lora import MODULES, Adapter, module_span

    rng = np.random.default_rng(0)
    adapter = Adapter("bench", "random", rank, [{} for _ in range(config.num_layers)])
    for i, modules in enumerate(adapter.layers):
        for module in MODULES:
            _, _, out, width = module_span(config, i, module)
            modules[module] = (rng.standard_normal((rank, width), np.float32) / np.sqrt(width),
                               rng.standard_normal((out, rank), np.float32) * np.float32(0.01))
    return adapter


def bench_prefill(runner, ids, repeats, chunk, adapter=None):
    """Tokens a second of one prompt prefilled in steps of chunk tokens (the whole prompt at once
    for 0), each on the cache the steps before it wrote, as the server's chunked prefill runs."""
    table = list(range(-(-len(ids) // runner.block_size)))
    chunk = chunk or len(ids)
    slot = runner.state_slots - 1  # a hybrid's state: the last slot (decode rows take the others)
    plans = [StepPlan([Row("p", ids[at:at + chunk], at, table, sample=at + chunk >= len(ids), state_slot=slot,
                           adapter=adapter)])
             for at in range(0, len(ids), chunk)]
    runner.step(plans[0])  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for plan in plans:
            runner.step(plan)
        times.append(time.perf_counter() - t)
    return len(ids) / statistics.median(times)


def bench_decode(runner, ids, batch, context, steps, adapter=None):
    bs = runner.block_size
    per_row = -(-(context + steps + 1) // bs)
    rows = []
    for b in range(batch):
        prompt = ids[b * 3: b * 3 + context]
        table = list(range(b * per_row, (b + 1) * per_row))
        runner.step(StepPlan([Row(b, prompt, 0, table, state_slot=b, adapter=adapter)]))  # fill the cache, no sampling
        rows.append(Row(b, [prompt[-1]], context, table, sample=True, state_slot=b, adapter=adapter))
    times = []
    for step in range(steps + 1):
        t = time.perf_counter()
        out = runner.step(StepPlan(rows))
        if step:  # the first step is a warm-up
            times.append(time.perf_counter() - t)
        rows = [Row(r.request_id, [s.token_id], r.start_pos + 1, r.block_table, sample=True, state_slot=r.state_slot,
                    adapter=adapter) for r, s in zip(rows, out)]
    return batch / statistics.median(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="prefill in steps of this many tokens, as the server's --prefill-chunk (0: one step)")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=256, help="tokens already cached per decode row")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "numpy"),
                        help="cpu: numba kernels (the server's default); numpy: the reference")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "q8_0"), help="weights on --backend cpu")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="every row through a random LoRA adapter of this rank on every dense projection (0: none)")
    args = parser.parse_args()

    from model.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    ids = Tokenizer(model_dir).encode(TEXT)
    ids = ids * -(-args.prompt_tokens // len(ids))  # a long prompt repeats the text
    batches = [int(b) for b in args.batches.split(",") if b]
    need = max([*batches, 0]) * -(-(args.context + args.steps + 1) // 16) + 64 + args.prompt_tokens // 16
    bandwidth = copy_bandwidth()
    backend = resolve(args.backend, args.dtype)
    model = backend.load(model_dir)
    runner = ModelRunner(model.config, model, num_blocks=need, seed=0, state_slots=max([*batches, 0]) + 1)
    adapter = None
    if args.lora_rank:
        runner.serve_adapters(1, args.lora_rank)
        runner.load_adapter(random_adapter(model.config, args.lora_rank), 0)
        adapter = AdapterUse(0)

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}, {blas_info()}")
    lora = f", a rank-{args.lora_rank} LoRA adapter on every row" if args.lora_rank else ""
    print(f"# model {model_dir.name}, backend {backend.name} ({backend.dtype}), context {args.context} per decode row"
          + lora)
    reads = bytes_per_token(runner.model)
    print(f"# a decode token reads {reads / 2**20:.0f} MiB of weights; memory copy {bandwidth / 1e9:.1f} GB/s,"
          f" so batch 1 at most {bandwidth / reads:.1f} tok/s")
    print("| measurement | tok/s | ms/step |")
    print("| --- | ---: | ---: |")
    rate = bench_prefill(runner, ids[:args.prompt_tokens], args.prefill_repeats, args.prefill_chunk, adapter)
    steps = f", chunks of {args.prefill_chunk}" if args.prefill_chunk else ""
    print(f"| prefill {args.prompt_tokens} tokens{steps} | {rate:.0f} | {1000 * args.prompt_tokens / rate:.0f} |")
    for batch in batches:
        rate, step = bench_decode(runner, ids, batch, args.context, args.steps, adapter)
        share = f" ({rate * reads / bandwidth:.0%} of the copy bandwidth)" if batch == 1 else ""
        print(f"| decode batch {batch}{share} | {rate:.1f} | {1000 * step:.1f} |")


if __name__ == "__main__":
    main()
