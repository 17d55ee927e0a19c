"""`spool bench`: offline throughput, as `vllm bench throughput` measures it. --num-prompts
prompts of random ids, all submitted at once to the engine (no HTTP), greedy, each generating
exactly --output-len tokens; the result is requests, total tokens and output tokens per second
of wall time. tools/bench_engine.py breaks the same run down per step.
"""

import sys
import time

import numpy as np
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from app.flags import attach_proposer, extra_kv_layers, fetch_model, kv_cache_type, prefill_beside_decode, \
    speculative_config
from model.backend import resolve
from model.kv_cache import DEFAULT_BLOCK_SIZE
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer


def make_prompts(tokenizer, count, length, seed):
    """Distinct prompts of random ids from the non-special vocabulary."""
    special = {i for i, t in tokenizer.hf.get_added_tokens_decoder().items() if t.special}
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), np.fromiter(special, dtype=np.int64))
    rng = np.random.default_rng(seed)
    return [rng.choice(allowed, size=length).tolist() for _ in range(count)]


async def run_requests(engine, prompts, output_len):
    """Submit everything at once; one client task per request drains its channel. Returns
    (wall seconds, generated tokens, finish reasons, start time, event-loop thread CPU seconds)."""
    params = GenerationParams(sampling=SamplingParams(temperature=0.0), max_tokens=output_len, ignore_eos=True)
    tokens, reasons = [0], []

    async def client(recv):
        async with recv:
            async for frame in recv:
                tokens[0] += len(frame.token_ids)
                if frame.finish_reason is not None:
                    reasons.append(frame.finish_reason)
                    return

    async with trio.open_nursery() as nursery:
        cpu, t0 = time.thread_time(), time.perf_counter()
        for ids in prompts:
            _, recv = engine.submit(ids, params)
            nursery.start_soon(client, recv)
    return time.perf_counter() - t0, tokens[0], reasons, t0, time.thread_time() - cpu


def run_bench(args) -> int:
    """A value that can never work raises ValueError, which the command prints as one line."""
    for name in ("num_prompts", "input_len", "output_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    backend = resolve(args.backend, args.dtype, kv_cache_type(args))
    model_dir = fetch_model(args)
    tokenizer = Tokenizer(args.tokenizer or model_dir)
    model = backend.load(model_dir, args.max_model_len)
    length = args.input_len + args.output_len
    if length > model.config.max_position_embeddings:
        raise ValueError(f"--input-len plus --output-len ({length}) is over the model's context"
                         f" ({model.config.max_position_embeddings})")
    running = min(args.num_prompts, args.max_num_seqs)
    speculative = speculative_config(args)
    runner = ModelRunner(model.config, model, num_blocks=running * -(-length // DEFAULT_BLOCK_SIZE), seed=0,
                         extra_layers=extra_kv_layers(speculative))
    attach_proposer(runner, speculative, backend, model_dir, tokenizer)
    engine = Engine(runner, tokenizer, EngineConfig(
        max_model_len=length, max_seqs=args.max_num_seqs, prefill_chunk=args.prefill_chunk,
        prefill_beside_decode=prefill_beside_decode(args, backend.name),
        max_batched_tokens=max(args.max_num_batched_tokens, running), max_queue=args.num_prompts + 2,
        prefix_caching=args.enable_prefix_caching, decode_log_interval=0, speculative=speculative))
    warmup = make_prompts(tokenizer, 2, min(args.input_len, 32), seed=1)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, seed=0)

    async def bench():
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await run_requests(engine, warmup, min(4, args.output_len))  # code paths and thread pools warm
            result = await run_requests(engine, prompts, args.output_len)
            nursery.cancel_scope.cancel()
        return result

    wall, generated, reasons, _, _ = trio.run(bench)
    if generated != args.num_prompts * args.output_len or set(reasons) != {"length"}:
        print(f"error: {generated} tokens generated, finish reasons {sorted(set(reasons))}", file=sys.stderr)
        return 1
    total = args.num_prompts * args.input_len + generated
    kv = kv_cache_type(args)
    print(f"model {model_dir.name}, {backend.name} ({backend.dtype}{'' if kv == 'f16' else f', {kv} K/V'});"
          f" {args.num_prompts} prompts x {args.input_len}"
          f" tokens in, {args.output_len} out; max-num-seqs {args.max_num_seqs}")
    print(f"Throughput: {args.num_prompts / wall:.2f} requests/s, {total / wall:.2f} total tokens/s,"
          f" {generated / wall:.2f} output tokens/s")
    return 0
