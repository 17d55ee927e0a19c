"""Kernel bandwidth: paged decode attention and RMSNorm in GB/s, against a plain device copy
measured in the same run, on Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128,
hidden 4096, bf16). The aim (issue 12): both at 80% or more of the copy's bandwidth. And
prefill attention of one --prefill-token prompt in TFLOP/s, on CUDA cores and on tensor cores.

    python tools/bench_kernels.py                       # on the GPU (CuPy and a device)
    python tools/bench_kernels.py --backend cpu --small # the same script through the CPU harness

--backend cpu runs the unmodified kernels through the CPU shim (tests/cuda_harness.py): its
numbers mean nothing, but it checks the script before a GPU session spends minutes on it.
Bytes counted: what a kernel must move at least (decode attention: every K and V row of every
context once, plus q and out; RMSNorm: x read and out written; the copy: read plus write).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the CPU harness

from model.ops.dtypes import to_bf16  # noqa: E402
from model.ops.cuda_ops import PREFILL_ROWS, PREFILL_TC_ROWS, prefill_shared_bytes, prefill_variant  # noqa: E402
from model.ops.decode_attention import DECODE_MIN_SPLIT, decode_blocks, decode_splits, split_blocks  # noqa: E402
from model.ops.kernels import name_expression  # noqa: E402

SHAPES = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "block_size": 16}


def backend(name: str):
    """(array module, launcher, timer): the timer runs fn `repeat` times and returns seconds per run."""
    if name == "gpu":
        import cupy

        from model.ops.cupy_ops import RawModuleLauncher

        def timer(fn, repeat):
            fn()  # warm-up: compiles and loads the module
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(repeat):
                fn()
            stop.record()
            stop.synchronize()
            return cupy.cuda.get_elapsed_time(start, stop) / 1000 / repeat

        return cupy, RawModuleLauncher(), timer
    from cuda_harness import CpuLauncher

    def timer(fn, repeat):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat

    return np, CpuLauncher(), timer


def bf16_random(xp, shape, rng):
    """Random normal values as bf16 bit patterns (uint16), as the kernels read them."""
    return xp.asarray(to_bf16(rng.standard_normal(shape).astype(np.float32)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for the CPU harness")
    parser.add_argument("--seqs", type=int, default=64, help="decode: sequences (default: 64)")
    parser.add_argument("--context", type=int, default=4096, help="decode: tokens of context each (default: 4096)")
    parser.add_argument("--rows", type=int, default=16384, help="RMSNorm: rows of 4096 (default: 16384)")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill: prompt tokens (default: 2048)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs of each (default: 20)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    if args.small:
        args.seqs, args.context, args.rows, args.prefill, args.repeat = 2, 40, 4, 40, 1
    xp, launcher, timer = backend(args.backend)
    rng = np.random.default_rng(0)
    s = SHAPES
    results = {}

    # The copy: the bandwidth the others are measured against.
    nbytes = max(64 << 20, args.rows * s["hidden"] * 2) if not args.small else 1 << 16
    src, dst = xp.zeros(nbytes // 2, dtype=np.uint16), xp.empty(nbytes // 2, dtype=np.uint16)
    seconds = timer(lambda: xp.copyto(dst, src), args.repeat)
    results["copy"] = {"bytes": 2 * nbytes, "seconds": seconds}

    # RMSNorm, one block per row.
    x = bf16_random(xp, (args.rows, s["hidden"]), rng)
    weight, out = bf16_random(xp, (s["hidden"],), rng), xp.empty_like(x)
    rms = launcher.function("rms_norm.cu", name_expression("rms_norm", "bfloat16"))
    seconds = timer(lambda: rms((args.rows,), (256,), (out, x, weight, np.int32(s["hidden"]), np.float32(1e-5))),
                    args.repeat)
    results["rms_norm"] = {"bytes": 2 * x.size * 2 + s["hidden"] * 2, "seconds": seconds}

    # Paged decode attention: every sequence at the same context, blocks scattered over the pool.
    blocks_each = -(-args.context // s["block_size"])
    num_blocks = args.seqs * blocks_each
    cache_shape = (s["kv_heads"], num_blocks, s["block_size"], s["head_dim"])
    cache_k, cache_v = bf16_random(xp, cache_shape, rng), bf16_random(xp, cache_shape, rng)
    tables = xp.asarray(rng.permutation(num_blocks).reshape(args.seqs, blocks_each).astype(np.int32))
    context_lens = xp.asarray(np.full(args.seqs, args.context, dtype=np.int32))
    q = bf16_random(xp, (args.seqs, s["heads"], s["head_dim"]), rng)
    attn_out = xp.empty_like(q)
    instance, blocks = decode_blocks(s["heads"], s["kv_heads"], s["head_dim"], "bfloat16")
    splits = min(decode_splits(launcher.multiprocessors, blocks), -(-args.context // DECODE_MIN_SPLIT))
    part_max = xp.empty((args.seqs, s["heads"], splits), dtype=np.float32)
    part_sum = xp.empty_like(part_max)
    part_acc = xp.empty((args.seqs, s["heads"], splits, s["head_dim"]), dtype=np.float32)
    decode = launcher.function("decode_attention.cu", name_expression("decode_attention", "bfloat16", instance))
    reduce = launcher.function("decode_attention.cu", name_expression("decode_attention_reduce", "bfloat16"))

    def attention():
        decode((blocks, args.seqs, split_blocks(args.seqs, blocks, splits, launcher.multiprocessors)), (128,), (
            part_max, part_sum, part_acc, q, cache_k, cache_v, tables, context_lens, np.int32(s["heads"]),
            np.int32(s["kv_heads"]), np.int32(s["head_dim"]), np.int32(s["block_size"]), np.int32(blocks_each),
            np.int32(num_blocks), np.int32(DECODE_MIN_SPLIT), np.int32(splits), np.float32(s["head_dim"] ** -0.5),
            np.int32(0),
            np.float32(0.0)))
        reduce((s["heads"], args.seqs), (128,), (attn_out, part_max, part_sum, part_acc, np.int32(s["heads"]),
                                                 np.int32(s["head_dim"]), np.int32(splits), np.uint64(0)))

    seconds = timer(attention, args.repeat)
    kv_bytes = 2 * args.seqs * args.context * s["kv_heads"] * s["head_dim"] * 2
    results["decode_attention"] = {"bytes": kv_bytes + 2 * q.size * 2, "seconds": seconds}

    # Prefill attention: one whole prompt, causal; 4 flops a (query, key, dim) the causal half sees.
    n = args.prefill
    pages = -(-n // s["block_size"])
    cache_shape = (s["kv_heads"], pages, s["block_size"], s["head_dim"])
    cache_k, cache_v = bf16_random(xp, cache_shape, rng), bf16_random(xp, cache_shape, rng)
    table = xp.asarray(rng.permutation(pages).reshape(1, pages).astype(np.int32))
    q = bf16_random(xp, (n, s["heads"], s["head_dim"]), rng)
    prefill_out = xp.empty_like(q)
    starts, lens = xp.asarray(np.array([0, n], dtype=np.int32)), xp.asarray(np.array([n], dtype=np.int32))
    flops = 4 * s["heads"] * s["head_dim"] * n * (n + 1) // 2
    for name, rows in (("prefill_attention", PREFILL_ROWS), ("prefill_attention_tc", PREFILL_TC_ROWS)):
        variant = prefill_variant(name, s["head_dim"])
        kernel = launcher.function(f"{name}.cu", name_expression(name, "bfloat16", variant))
        shared = kernel.max_dynamic_shared_size_bytes = prefill_shared_bytes(name, s["head_dim"], 2)
        grid = (-(-n * (s["heads"] // s["kv_heads"]) // rows), 1, s["kv_heads"])
        args_ = (prefill_out, q, cache_k, cache_v, starts, lens, table, np.int32(s["heads"]), np.int32(s["kv_heads"]),
                 np.int32(s["head_dim"]), np.int32(s["block_size"]), np.int32(pages), np.int32(pages),
                 np.float32(s["head_dim"] ** -0.5), np.int32(0), np.float32(0.0), np.uint64(0))
        seconds = timer(lambda: kernel(grid, (128,), args_, shared_mem=shared), args.repeat)
        results[name] = {"bytes": 2 * (2 * q.size + 2 * cache_k.size), "seconds": seconds, "flops": flops}

    copy_rate = results["copy"]["bytes"] / results["copy"]["seconds"]
    print(f"# backend {args.backend}; decode: {args.seqs} x {args.context} tokens, {splits} splits; "
          f"RMSNorm: {args.rows} x {s['hidden']}; prefill: {n} tokens; bf16")
    print("| kernel | MB moved | time (us) | GB/s | of copy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        r["gb_per_s"] = r["bytes"] / r["seconds"] / 1e9
        r["of_copy"] = r["bytes"] / r["seconds"] / copy_rate
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {r['seconds'] * 1e6:.1f} | {r['gb_per_s']:.1f} | {r['of_copy']:.0%} |")
    for name in ("prefill_attention", "prefill_attention_tc"):
        results[name]["tflops"] = results[name]["flops"] / results[name]["seconds"] / 1e12
        print(f"# {name}: {results[name]['tflops']:.1f} TFLOP/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
