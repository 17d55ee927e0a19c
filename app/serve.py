"""`python -m app serve`: load the model, start the engine, serve HTTP and WebSocket until a
signal, then drain.

One nursery holds the engine and Hypercorn. The server listens before the model loads, so
/health answers 503 until it is ready. SIGINT or SIGTERM stops admitting (503), lets
in-flight requests finish for up to --shutdown-timeout, cancels the rest through the engine's
abort path, closes the server and exits 0. If the engine crashes, the nursery takes Hypercorn
down with it: there is never a server without a scheduler.
"""

import functools
import logging
import os
import signal
import sys
import time
from pathlib import Path

import trio

from app.engine import Engine, EngineConfig
from app.logs import configure_logging
from app.server import limits, tools
from app.server.app import create_app
from app.server.state import ServerState
from app.server.listener import serve_http
from model.default import DEFAULT_MODEL_NAME, resolve_model
from model.backend import BACKENDS, DTYPES, resolve
from model.errors import ModelError, one_line
from model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from model.memory import GIB, gpu_kv_blocks
from model.runner import ModelRunner
from model.tokenizer import Tokenizer, chat_template_text

log = logging.getLogger("spool")


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="a Hugging Face model directory or a .gguf file"
      " (default: SmolLM2-135M-Instruct, downloaded and converted on first use)")
    a("--served-model-name", default=None, help="the model name clients use (default: the directory's name)")
    a("--tokenizer", default=None, metavar="DIR",
      help="a directory whose tokenizer (tokenizer.json, its config, its chat template) replaces the model's")
    a("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
      help="a Jinja chat template, as a file or inline, in place of the tokenizer's own")
    a("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    a("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    a("--backend", choices=BACKENDS, default="auto",
      help="numerics backend: auto picks cuda when CuPy is installed and sees a GPU, else cpu (numba kernels);"
           " numpy is the plain NumPy reference (default: auto)")
    a("--dtype", choices=DTYPES, default="auto",
      help="weights, activations and KV cache: cuda takes bfloat16, float16 or float32 (auto: bfloat16);"
           " cpu takes q8_0 weights (auto with AVX-512; 8-bit blocks: a quarter of the memory or less, and faster;"
           " K/V in float16), q4_k (a Hugging Face checkpoint's weights quantized to Q4_K while loading, 4.75 bits"
           " a weight; those whose rows are not a multiple of 256 as q8_0), or float32 ones (the exact path; auto"
           " without AVX-512); a GGUF's quantized tensors keep their own types whatever the dtype, so q4_k serves"
           " one as q8_0 does (default: auto)")
    a("--max-seqs", type=int, default=64, help="most requests running at once (default: 64)")
    a("--max-model-len", type=int, default=None, help="context length, prompt plus output (default: the model's)")
    a("--kv-cache-gib", type=float, default=None,
      help="memory for the paged KV cache in GiB (default: 1.0 on the CPU; on a GPU, what --gpu-memory-utilization"
           " leaves)")
    a("--gpu-memory-utilization", type=float, default=0.9,
      help="CUDA: share of the GPU's memory for the weights, a step's activations and the KV cache; the KV cache"
           " gets what the other two leave, measured by a profiling step at start-up (default: 0.9)")
    a("--enforce-eager", action="store_true",
      help="CUDA: run decode steps kernel by kernel instead of replaying CUDA graphs captured at start-up")
    a("--prefill-chunk", type=int, default=256, help="most prompt tokens prefilled per step (default: 256)")
    a("--max-batched-tokens", type=int, default=1024, help="most tokens per step, decode rows included (default: 1024)")
    a("--swap-space", type=float, default=0.0,
      help="host memory in GiB to spill preempted requests' KV to (pinned on a GPU, copied on a side stream);"
           " 0 re-prefills them instead (default: 0)")
    a("--max-queue", type=int, default=1024, help="most requests waiting; more get HTTP 429 (default: 1024)")
    a("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    a("--api-key", default=os.environ.get("SPOOL_API_KEY"),
      help="require 'Authorization: Bearer KEY' on every route but /health (default: $SPOOL_API_KEY, else none)")
    a("--request-timeout", type=float, default=600.0, help="seconds a request may take; 0: no limit (default: 600)")
    a("--shutdown-timeout", type=float, default=30.0,
      help="seconds in-flight requests get to finish after SIGINT/SIGTERM (default: 30)")
    a("--tool-call-parser", default=None, metavar="NAME",
      help=f"how the model writes tool calls, by vLLM's parser names: {', '.join(tools.FORMATS)}"
           " (default: read from the chat template's markers, else hermes)")
    a("--no-ui", action="store_true", help="do not serve the chat page at /")
    a("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: info)")
    a("--log-format", default="text", choices=("text", "json"),
      help="text lines, or one JSON object a line for log shippers (default: text)")
    a("--disable-log-requests", action="store_true", help="no log line per request")
    a("--uvicorn-log-level", default=None, choices=("debug", "info", "warning", "error"),
      help="level of the HTTP layer's own logs: request lines, connections (default: --log-level)")
    limits.add_arguments(parser)


def validate_flags(args) -> None:
    """Flag values that can never work, as one line each (ValueError)."""
    for name in ("max_seqs", "prefill_chunk", "max_batched_tokens", "max_queue"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.kv_cache_gib is not None and args.kv_cache_gib <= 0) or args.swap_space < 0:
        raise ValueError("--kv-cache-gib must be positive and --swap-space not negative")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    if args.request_timeout < 0 or args.shutdown_timeout < 0:
        raise ValueError("--request-timeout and --shutdown-timeout must not be negative")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.tool_call_parser is not None and args.tool_call_parser not in tools.FORMATS:
        raise ValueError(f"--tool-call-parser {args.tool_call_parser!r} is not one of {', '.join(tools.FORMATS)}")
    if args.tokenizer is not None and not Path(args.tokenizer, "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer!r} is not a directory with a tokenizer.json")
    chat_template_text(args.chat_template)
    limits.Limits.from_args(args).validate()


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if not args.model:
        return DEFAULT_MODEL_NAME
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def load(args, state: ServerState) -> Engine:
    """Fetch and load the model, and build the engine: runs in a worker thread while the server
    already answers /health with 503."""
    backend = resolve(args.backend, args.dtype)
    model_dir = resolve_model(args.model)
    state.tokenizer = Tokenizer(args.tokenizer or model_dir, chat_template_text(args.chat_template))
    found = tools.detect(state.tokenizer.chat_template_source)
    state.tool_format = tools.FORMATS[args.tool_call_parser or found or "hermes"](state.tokenizer)
    state.tokenizer.keep_in_text(state.tool_format.marker_ids())
    log.info(f"tool calls in the {state.tool_format.name} format (from"
             f" {'--tool-call-parser' if args.tool_call_parser else 'the chat template' if found else 'no marker: the default'})")
    model = backend.load(model_dir, args.max_model_len)
    config = model.config
    state.max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    state.backend = f"{backend.name} ({backend.dtype})"
    state.model_path, state.model_type = str(model_dir), config.model_type
    state.architectures = list(config.architectures)
    block_bytes = KVCache.bytes_per_block(config, DEFAULT_BLOCK_SIZE, backend.ops.storage_dtype.itemsize)
    if backend.name == "cuda" and args.kv_cache_gib is None:
        num_blocks = gpu_kv_blocks(model, args.gpu_memory_utilization, args.max_seqs, args.max_batched_tokens,
                                   state.max_model_len)
    else:
        kv_cache_gib = args.kv_cache_gib or 1.0
        num_blocks = int(kv_cache_gib * GIB // block_bytes)
        if num_blocks < 2:
            raise ValueError(f"--kv-cache-gib {kv_cache_gib} holds fewer than 2 KV blocks of {block_bytes} bytes")
    try:
        runner = ModelRunner(config, model, num_blocks)
    except MemoryError as e:  # CuPy's OutOfMemoryError is one
        raise ValueError(f"out of memory allocating the KV cache of {num_blocks} blocks ({one_line(e)});"
                         " lower --gpu-memory-utilization or --kv-cache-gib") from None
    swap_blocks = int(args.swap_space * GIB // block_bytes)
    if backend.name == "cuda" and swap_blocks:
        try:
            runner.reserve_swap(swap_blocks)
        except Exception as e:  # pinning fails where the host has too little memory to lock
            raise ValueError(f"cannot pin --swap-space {args.swap_space:g} GiB of host memory ({one_line(e)});"
                             " lower --swap-space") from None
    if backend.name == "cuda" and not args.enforce_eager:
        capture_graphs(runner, args.max_seqs, state.max_model_len)
    engine = Engine(runner, state.tokenizer, EngineConfig(
        max_model_len=state.max_model_len, max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens,
        prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
        swap_blocks=swap_blocks, prefix_caching=not args.no_prefix_caching))
    log.info(f"model {model_dir} ({config.model_type}, {config.num_layers} layers), backend {backend.name}"
             f" ({backend.dtype}, weights {model.weight_bytes / 2**20:.0f} MiB),"
             f" KV cache {num_blocks} blocks x {DEFAULT_BLOCK_SIZE} tokens ({num_blocks * block_bytes / GIB:.2f} GiB:"
             f" {num_blocks * DEFAULT_BLOCK_SIZE / state.max_model_len:.1f} requests at full length),"
             f" max_model_len {state.max_model_len}")
    return engine


def capture_graphs(runner, max_seqs: int, max_model_len: int) -> None:
    """Decode graphs for every padded batch size; a device that refuses them is served eagerly."""
    started = time.monotonic()
    try:
        runner.capture_graphs(max_seqs, max_model_len)
    except Exception as e:
        log.warning(f"CUDA graphs could not be captured ({one_line(e)}); decoding eagerly")
        runner.graphs = None
        return
    log.info(f"captured {len(runner.graphs.sizes)} decode graphs (batch sizes up to {max_seqs})"
             f" in {time.monotonic() - started:.1f} s")


async def serve(state: ServerState, args, load_engine) -> str | None:
    """Listen at once, load in a worker thread, then serve until a signal; returns why listening
    or loading failed, or None."""
    stop = trio.Event()

    async def on_signal():
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if state.engine is not None:
                    log.info(f"{signal.Signals(signum).name}: draining for up to {args.shutdown_timeout:g} s")
                    await state.engine.drain(args.shutdown_timeout)
                stop.set()
                return

    async with trio.open_nursery() as nursery:
        async def http(task_status=trio.TASK_STATUS_IGNORED):
            # After the drain below, only final frames are left to flush: 5 s is plenty.
            await serve_http(create_app(state), state.limits, state.connections, args.host, args.port,
                             stop.wait, graceful_timeout=5.0, task_status=task_status)
            nursery.cancel_scope.cancel()  # the server has closed: the engine goes with it

        nursery.start_soon(on_signal)
        bind_error = None
        try:
            await nursery.start(http)
        except* OSError as group:  # raised inside the listener's nursery
            bind_error = group
            while isinstance(bind_error, BaseExceptionGroup):
                bind_error = bind_error.exceptions[0]
        if bind_error is not None:
            nursery.cancel_scope.cancel()
            return f"cannot listen on {args.host}:{args.port} ({bind_error.strerror or bind_error}); pick another --port"
        log.info(f"listening on http://{args.host}:{args.port}; loading the model")
        try:
            engine = await trio.to_thread.run_sync(load_engine)
        except (ValueError, ModelError) as e:
            stop.set()
            return str(e)
        await nursery.start(engine.run)
        state.engine = engine
        log.info(f"Spool serving {state.model_name!r} on http://{args.host}:{args.port}")
    log.info("stopped")
    return None


def run_serve(args) -> int:
    configure_logging(args)
    try:
        validate_flags(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = ServerState(model_name=model_name(args), api_key=args.api_key or None, ui=not args.no_ui,
                        request_timeout=args.request_timeout or None, limits=limits.Limits.from_args(args))
    failure = trio.run(serve, state, args, functools.partial(load, args, state))
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0
