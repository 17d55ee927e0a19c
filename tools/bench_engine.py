"""Offline throughput of the Engine (planner + Trio tick + model): N requests with distinct
random prompts, all submitted at t=0, greedy, ignore_eos, max_tokens=--output-len.

    python tools/bench_engine.py [--model DIR|FILE.gguf | --shape llama3-8b]
        [--backend cpu|numpy|cuda] [--dtype ...] [--requests 64] [--input-len 128]
        [--output-len 64] [--max-seqs N] [--prefill-chunk 256] [--max-batched-tokens 1024]
        [--kv-blocks B] [--prefix-caching on|off] [--enforce-eager] [--json FILE] [--profile [FILE]]

The runner is wrapped in a thin timer. Every launch (runner.launch: on the CPU the model and its
sampling; on a GPU the queueing of that work) and every collect (the wait for the sampled ids)
is timed on the host. Engine overhead is everything else: wall time minus the launches and
collects, i.e. the event loop's scheduling, result handling, thread hand-offs and the client
tasks that drain each request's channel. Per step it is the gap from one launch's start to the
next one's, minus the launch. "at N running" keeps only the steps whose plan is
N = min(requests, max-seqs) decode rows: the steady state once every prompt is prefilled.

On a GPU (--backend cuda) CUDA events bracket each launch on the device's stream, so the table
also gives each step's device time and the device's idle share: the time between one step's
last queued work and the next step's first, over the steps at N running (the overlapped loop
should keep it near zero). --shape makes a model of that shape with random weights drawn on the
device (tools/random_model.py): nothing is downloaded. The first lines then also give the
device's copy bandwidth and the batch-1 floor it sets: weight bytes over it.

--profile runs cProfile on the event-loop thread (the runner's worker thread is not profiled)
and prints the top functions to stderr, or writes pstats to FILE; profiling slows the event
loop, so take the timings from a run without it.
"""

import argparse
import bisect
import cProfile
import json
import math
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import model  # noqa: E402, F401  (first: it sets the thread pools' environment before NumPy loads)
import numpy as np  # noqa: E402
import trio  # noqa: E402

from app.engine import Engine, EngineConfig  # noqa: E402
from app.bench import make_prompts, run_requests  # noqa: E402
from app.engine.planner import PlannerConfig  # noqa: E402
from bench_model import blas_info  # noqa: E402
from model.backend import resolve  # noqa: E402
from model.choices import BACKENDS, DTYPES  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.default import resolve_model  # noqa: E402
from model.kv_cache import DEFAULT_BLOCK_SIZE  # noqa: E402
from model.runner import ModelRunner, load_model  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from random_model import SHAPES, random_model, write_model_dir  # noqa: E402


class DeviceClock:
    """CUDA events on the current stream: mark() records one, ms(a, b) is the device time
    between two (after a synchronize)."""

    def __init__(self):
        import cupy

        self.cupy = cupy

    def mark(self):
        event = self.cupy.cuda.Event()
        event.record()
        return event

    def ms(self, a, b) -> float:
        return self.cupy.cuda.get_elapsed_time(a, b)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def copy_bandwidth(self, nbytes: int = 1 << 30) -> float:
        """Bytes per second a device-to-device copy moves (each byte read once and written once)."""
        src = self.cupy.ones(nbytes // 4, dtype=np.float32)
        dst = self.cupy.empty_like(src)
        dst[...] = src  # warm
        start = self.mark()
        for _ in range(5):
            dst[...] = src
        end = self.mark()
        self.synchronize()
        return 2 * 5 * nbytes / (self.ms(start, end) / 1000)


class TimedRunner:
    """The runner contract, passed through, with every launch and collect timed (perf_counter),
    and bracketed on the device when there is one."""

    def __init__(self, runner, events, clock=None):
        self.runner, self.events, self.clock = runner, events, clock
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size
        self.overlaps = runner.overlaps

    def launch(self, plan):
        begin = self.clock.mark() if self.clock else None
        t0 = time.perf_counter()
        out = self.runner.launch(plan)
        t1 = time.perf_counter()
        end = self.clock.mark() if self.clock else None
        decode = sum(1 for r in plan.rows if len(r.token_ids) == 1 and r.start_pos >= len(r.prompt_ids))
        self.events.append(("step", t0, t1, len(plan.rows), decode, begin, end))
        return out

    def collect(self, launched):
        t0 = time.perf_counter()
        out = self.runner.collect(launched)
        self.events.append(("collect", t0, time.perf_counter(), None))
        return out

    def release(self, request_id):
        self.runner.release(request_id)

    def save_blocks(self, block_ids):
        return self.runner.save_blocks(block_ids)

    def load_blocks(self, block_ids, data):
        return self.runner.load_blocks(block_ids, data)

    def drop_spill(self, data):
        self.runner.drop_spill(data)


def timed(events, kind, fn, active, cpu_clock=False):
    """Time an engine method, unless it is called from inside another timed one (next_step()
    closes what it retires); with cpu_clock, also note the event-loop thread's CPU clock (a syscall,
    about 0.5 us) at its start."""
    def wrapper(*args, **kwargs):
        if active:
            return fn(*args, **kwargs)
        active.append(kind)
        cpu, t0 = time.thread_time() if cpu_clock else None, time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((kind, t0, time.perf_counter(), cpu))
            active.pop()
    return wrapper


def analyse(events, t_end, clock=None):
    """One window per step, from its launch's start to the next one's (the last ends at t_end),
    with the launch and collect time, and the schedule/apply/retire time that fell inside it; with
    a device clock, the step's device time and the device's idle time before the next step."""
    steps = [e for e in events if e[0] == "step"]
    other = sorted((e for e in events if e[0] != "step"), key=lambda e: e[1])
    schedules = [e for e in other if e[0] == "schedule"]
    starts = [e[1] for e in schedules]
    windows = []
    j = 0
    for i, (_, s0, s1, rows, decode, begin, end_mark) in enumerate(steps):
        end = steps[i + 1][1] if i + 1 < len(steps) else t_end
        w = {"period": end - s0, "forward": s1 - s0, "rows": rows, "decode": decode,
             "schedule": 0.0, "apply": 0.0, "retire": 0.0, "collect": 0.0}
        if clock is not None:
            w["device"] = clock.ms(begin, end_mark) / 1000
            w["idle"] = max(0.0, clock.ms(end_mark, steps[i + 1][5]) / 1000) if i + 1 < len(steps) else None
        while j < len(other) and other[j][1] < s0:
            j += 1
        k = j
        while k < len(other) and other[k][1] < end:
            w[other[k][0]] += other[k][2] - other[k][1]
            k += 1
        at = bisect.bisect_left(starts, s0)  # schedules[at - 1] planned this step
        has_next = at < len(starts) and starts[at] < end
        w["loop_cpu"] = schedules[at][3] - schedules[at - 1][3] if at and has_next else None
        windows.append(w)
    return windows


def device_line(clock, llama, steady) -> dict:
    """The copy bandwidth, the batch-1 floor it sets, and the device's time and idle share over
    the steady steps."""
    bandwidth = clock.copy_bandwidth()
    floor = llama.weight_bytes / bandwidth
    timed = [w for w in steady if w["idle"] is not None]
    busy, idle = sum(w["device"] for w in timed), sum(w["idle"] for w in timed)
    result = {"copy_bandwidth_gbs": bandwidth / 1e9, "weight_gib": llama.weight_bytes / 2**30,
              "floor_ms": 1000 * floor, "device_ms_per_step": 1000 * busy / max(1, len(timed)),
              "idle_share": idle / (busy + idle) if timed else math.nan}
    print(f"# device: copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s; weights"
          f" {result['weight_gib']:.2f} GiB, so a step that reads them once takes at least"
          f" {result['floor_ms']:.2f} ms; at steady state {result['device_ms_per_step']:.2f} ms of device time"
          f" per step, idle {100 * result['idle_share']:.1f}% of the time between steps")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="instead of --model: this shape with random weights drawn where the ops keep them")
    parser.add_argument("--backend", default="cpu", choices=[b for b in BACKENDS if b != "auto"],
                        help="cpu: numba kernels (the server's default on a CPU); numpy: the reference; cuda: a GPU")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="as serve's --dtype")
    parser.add_argument("--enforce-eager", action="store_true", help="cuda: no CUDA graphs")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-seqs", type=int, default=None, help="default: --requests")
    parser.add_argument("--prefill-chunk", type=int, default=PlannerConfig.prefill_chunk)
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help=f"default: the engine's ({PlannerConfig.max_batched_tokens}), or max-seqs if larger")
    parser.add_argument("--kv-blocks", type=int, default=None, help="default: enough for every request at once")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--profile", nargs="?", const="-", default=None,
                        help="cProfile the event-loop thread; print to stderr, or write pstats to FILE")
    args = parser.parse_args()
    n = args.requests
    max_seqs = args.max_seqs or n
    max_batched = args.max_batched_tokens or max(PlannerConfig.max_batched_tokens, max_seqs)

    model_dir = write_model_dir(tempfile.mkdtemp(), args.shape) if args.shape else resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    bs = DEFAULT_BLOCK_SIZE
    per_request = -(-(args.input_len + args.output_len) // bs)
    kv_blocks = args.kv_blocks or min(n, max_seqs) * per_request
    backend = resolve(args.backend, args.dtype)
    ops = backend.prepare(ModelConfig.load(model_dir))
    llama = random_model(model_dir, ops) if args.shape else load_model(model_dir, ops)
    runner = ModelRunner(llama.config, llama, num_blocks=kv_blocks, block_size=bs, seed=0)
    max_model_len = min(llama.config.max_position_embeddings, args.input_len + args.output_len + 32)
    clock = DeviceClock() if backend.name == "cuda" else None
    if clock and not args.enforce_eager:
        started = time.perf_counter()
        try:
            runner.capture_graphs(max_seqs, max_model_len)
            print(f"# captured {len(runner.graphs.sizes)} decode graphs in {time.perf_counter() - started:.1f} s")
        except Exception as e:  # as serve does: measure eagerly, and say so
            runner.graphs = None
            print(f"# CUDA graphs could not be captured ({type(e).__name__}: {e}); decoding eagerly")
    events = []
    timed_runner = TimedRunner(runner, events, clock)
    config = EngineConfig(max_model_len=max_model_len, max_seqs=max_seqs,
                          prefill_chunk=args.prefill_chunk, max_batched_tokens=max_batched,
                          max_queue=max(n, EngineConfig.max_queue),
                          prefix_caching=args.prefix_caching == "on", decode_log_interval=0)
    warmup = make_prompts(tokenizer, 2, min(args.input_len, 32), seed=args.seed + 1)
    prompts = make_prompts(tokenizer, n, args.input_len, seed=args.seed)
    assert len({tuple(p) for p in prompts}) == n

    async def bench():
        engine = Engine(timed_runner, tokenizer, config)
        active = []
        for kind, name in (("schedule", "next_step"), ("apply", "apply"), ("retire", "retire")):
            setattr(engine, name, timed(events, kind, getattr(engine, name), active, cpu_clock=kind == "schedule"))
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            await run_requests(engine, warmup, 4)  # code paths and BLAS threads warm
            events.clear()
            profiler = cProfile.Profile() if args.profile else None
            if profiler:
                profiler.enable()
            result = await run_requests(engine, prompts, args.output_len)
            if profiler:
                profiler.disable()
            nursery.cancel_scope.cancel()
        return result + (profiler,)

    wall, generated, reasons, t0, loop_cpu, profiler = trio.run(bench)
    assert len(reasons) == n and set(reasons) == {"length"}, reasons
    assert generated == n * args.output_len, generated
    if clock:
        clock.synchronize()
    windows = analyse(events, t0 + wall, clock)
    forward = sum(w["forward"] + w["collect"] for w in windows)
    full = min(n, max_seqs)  # the most requests that run at once
    steady = [w for w in windows if w["rows"] == full and w["decode"] == full]

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__},"
          f" {blas_info()}")
    device = device_line(clock, llama, steady) if clock else {}
    print(f"# model {model_dir.name}, {backend.name} {backend.dtype}; {n} requests x {args.input_len} prompt + {args.output_len} output"
          f" tokens, max_seqs {max_seqs}, prefill_chunk {args.prefill_chunk}, max_batched_tokens"
          f" {max_batched}, {kv_blocks} KV blocks, prefix caching {args.prefix_caching}")
    print(f"# wall {wall:.2f} s, {len(windows)} steps, output {generated / wall:.1f} tok/s,"
          f" prompt + output {(n * args.input_len + generated) / wall:.1f} tok/s;"
          f" engine overhead {100 * (wall - forward) / wall:.1f}% of wall ({wall - forward:.3f} s)")

    labels = ["steps", "ms per step", "launch ms (the CPU's forward; a GPU's queueing)", "collect ms (waiting for ids)",
              "overhead ms (step time outside launch and collect)", "overhead share", "of it: next_step() ms",
              "of it: apply() ms", "of it: retire() ms", "of it: other ms (thread hop, client tasks, Trio)",
              "event-loop thread CPU ms (also what overlaps the forward)", "output tok/s"]

    def column(ws, period=None, cpu=None):
        if not ws:
            return ["-"] * len(labels)
        count = len(ws)
        period = period if period is not None else sum(w["period"] for w in ws)
        launch, wait = sum(w["forward"] for w in ws), sum(w["collect"] for w in ws)
        over = period - launch - wait
        sched, app, fl = (sum(w[k] for w in ws) for k in ("schedule", "apply", "retire"))
        if cpu is None:
            known = [w["loop_cpu"] for w in ws if w["loop_cpu"] is not None]
            cpu = sum(known) / len(known) * count if known else math.nan
        tokps = sum(w["decode"] for w in ws) / period  # one token per decode row

        def ms(x):
            return f"{1000 * x / count:.2f}"

        return [str(count), ms(period), ms(launch), ms(wait), ms(over), f"{100 * over / period:.1f}%", ms(sched),
                ms(app), ms(fl), ms(over - sched - app - fl), ms(cpu), f"{tokps:.1f}"]

    all_col = column(windows, wall, loop_cpu)
    all_col[-1] = f"{generated / wall:.1f}"  # prefill rows that sample count too
    steady_col = column(steady)
    print(f"| measurement | all steps | at {full} running |")
    print("| --- | ---: | ---: |")
    for label, a, b in zip(labels, all_col, steady_col):
        print(f"| {label} | {a} | {b} |")
    if steady:
        spread = [1000 * (w["period"] - w["forward"] - w["collect"]) for w in steady]
        print(f"# at {full} running: overhead per step median {statistics.median(spread):.2f} ms,"
              f" min {min(spread):.2f}, max {max(spread):.2f}")
    if args.json:
        steady_period = sum(w["period"] for w in steady)
        Path(args.json).write_text(json.dumps({
            "backend": backend.name, "dtype": backend.dtype, "model": args.shape or model_dir.name, "requests": n,
            "input_len": args.input_len, "output_len": args.output_len, "max_seqs": max_seqs, "wall_s": wall,
            "output_tok_s": generated / wall, "running": full, "steady_steps": len(steady),
            "steady_ms_per_step": 1000 * steady_period / len(steady) if steady else None,
            "steady_decode_tok_s": sum(w["decode"] for w in steady) / steady_period if steady else None,
            "graphs": runner.graphs is not None, **device}, indent=2))

    if profiler:
        if args.profile == "-":
            stats = pstats.Stats(profiler, stream=sys.stderr)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
        else:
            profiler.dump_stats(args.profile)
            print(f"# profile written to {args.profile}")


if __name__ == "__main__":
    main()
