"""`spool serve` (or `python -m app serve`): load the model, start the engine, serve HTTP and
WebSocket until a signal, then drain.

One nursery holds the engine and Hypercorn. The server listens before the model loads, so
/health answers 503 until it is ready. SIGINT or SIGTERM stops admitting (503), lets
in-flight requests finish for up to --shutdown-timeout, cancels the rest through the engine's
abort path, closes the server and exits 0. If the engine crashes, the nursery takes Hypercorn
down with it: there is never a server without a scheduler.
"""

import functools
import logging
import signal
import ssl
import sys
import time
from pathlib import Path

import trio

from app.engine import Engine, EngineConfig
from app.flags import (attach_proposer, extra_kv_layers, fetch_model, kv_cache_type, load_draft, prefill_beside_decode,
                       speculative_config)
from app.logs import configure_logging
from app.server import adapters, limits, reasoning, tools
from app.server.app import create_app
from app.server.responses.store import ResponseStore
from app.server.origins import OriginPolicy
from app.server.generation_config import sampling_defaults
from app.server.state import ServerState
from app.server.http.listener import serve_http
from model.default import DEFAULT_MODEL_NAME, resolve_model
from model.backend import check_kv_cache, cuda_available, resolve
from model.errors import ModelError, one_line
from model.hub import is_hub_id
from model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from model.memory import GIB, gpu_kv_blocks, model_weight_bytes, pool_block_bytes
from model.runner import ModelRunner
from model.tokenizer import Tokenizer, chat_template_text

log = logging.getLogger("spool")


def validate_flags(args) -> None:
    """Flag values that can never work, as one line each (ValueError)."""
    for name in ("max_num_seqs", "prefill_chunk", "max_num_batched_tokens", "max_queue", "prefill_beside_decode"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.kv_cache_gib is not None and args.kv_cache_gib <= 0) or args.swap_space < 0:
        raise ValueError("--kv-cache-gib must be positive and --swap-space not negative")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    if args.request_timeout < 0 or args.shutdown_timeout < 0:
        raise ValueError("--request-timeout and --shutdown-timeout must not be negative")
    if args.responses_store_ttl <= 0 or args.responses_store_bytes <= 0:
        raise ValueError("--responses-store-ttl and --responses-store-bytes must be positive")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.tokenizer is not None and not Path(args.tokenizer, "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer!r} is not a directory with a tokenizer.json")
    if args.tool_call_parser is not None and args.tool_call_parser not in tools.FORMATS:
        raise ValueError(f"--tool-call-parser {args.tool_call_parser!r} is not one of {', '.join(tools.FORMATS)}")
    if args.reasoning_parser is not None and args.reasoning_parser not in reasoning.PARSERS:
        raise ValueError(f"--reasoning-parser {args.reasoning_parser!r} is not one of {', '.join(reasoning.PARSERS)}")
    chat_template_text(args.chat_template)
    api_keys(args)
    tls_context(args)
    sampling_defaults("vllm" if args.generation_config == "auto" else args.generation_config, Path("."),
                      args.override_generation_config)  # the model's own file is read once it is fetched
    speculative_config(args)
    kv = kv_cache_type(args)
    auto = args.backend == "auto" and kv != "f16"  # a cache type one backend keeps: which one auto picks
    check_kv_cache(("cuda" if cuda_available() else "cpu") if auto else args.backend, args.dtype, kv)
    limits.Limits.from_args(args).validate()
    OriginPolicy.from_args(args)


def tls_context(args) -> ssl.SSLContext | None:
    """--ssl-certfile's and --ssl-keyfile's server context (TLS 1.2 and up), or None for plain HTTP."""
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile, the certificate it belongs to")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {args.ssl_certfile!r}"
                         + (f" with --ssl-keyfile {args.ssl_keyfile!r}" if args.ssl_keyfile else "")
                         + f" cannot be loaded: {e.strerror or e.reason or e}") from None
    return context


def api_keys(args) -> tuple[str, ...]:
    """--api-key's keys and --api-key-file's, one a line (blank lines and # comments aside)."""
    keys = list(args.api_key or ())
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).expanduser().read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file!r} cannot be read: {e.strerror or e}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if len(keys) == len(args.api_key or ()):
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
    return tuple(keys)


def model_names(args) -> list[str]:
    """The names clients may use, the first in replies: --served-model-name's, else the Hub id
    (its quant tag dropped, as vLLM names a model by its id), else the file's or directory's."""
    if args.served_model_name:
        return list(args.served_model_name)
    if not args.model:
        return [DEFAULT_MODEL_NAME]
    path = Path(args.model).expanduser()
    if not path.exists() and is_hub_id(args.model):
        return [args.model.split(":")[0]]
    return [path.stem if path.suffix == ".gguf" else path.name]


def load(args, state: ServerState) -> Engine:
    """Fetch and load the model, and build the engine: runs in a worker thread while the server
    already answers /health with 503."""
    backend = resolve(args.backend, args.dtype, kv_cache_type(args))
    model_dir = fetch_model(args)
    state.sampling_defaults = sampling_defaults(args.generation_config, model_dir, args.override_generation_config)
    if state.sampling_defaults:
        log.info(f"a request's sampling defaults are the generation config's {state.sampling_defaults}"
                 " (--generation-config vllm for OpenAI's)")
    state.tokenizer = Tokenizer(args.tokenizer or model_dir, chat_template_text(args.chat_template),
                                render_seconds=state.limits.chat_template_timeout,
                                render_chars=state.limits.max_chat_template_chars)
    found = tools.detect(state.tokenizer.chat_template_source)
    state.tool_format = tools.FORMATS[args.tool_call_parser or found or "hermes"](state.tokenizer)
    log.info(f"tool calls in the {state.tool_format.name} format (from"
             f" {'--tool-call-parser' if args.tool_call_parser else 'the chat template' if found else 'no marker: the default'})")
    state.reasoning = reasoning.PARSERS[args.reasoning_parser] if args.reasoning_parser else reasoning.detect(state.tokenizer)
    if state.reasoning == reasoning.THINK and state.tokenizer.think_ids is None:
        raise ValueError(f"--reasoning-parser {args.reasoning_parser} reads <think> tags, which are not tokens of this"
                         " model's vocabulary")
    markers = state.tool_format.marker_ids()
    if state.reasoning in reasoning.WHOLE:  # the reply's structure is read from the text, tool calls or not
        markers |= tools.FORMATS[reasoning.WHOLE[state.reasoning]](state.tokenizer).marker_ids()
    state.tokenizer.keep_in_text(markers)
    if state.reasoning:
        log.info(f"thinking in the {state.reasoning} format (from"
                 f" {'--reasoning-parser' if args.reasoning_parser else 'the chat template and vocabulary'})")
    if backend.name == "cuda":  # GGUF types that cuda_quant decodes stay packed; the rest become the storage type
        log.info(f"weights planned at {model_weight_bytes(model_dir, backend.dtype) / GIB:.2f} GiB on the GPU")
    model = backend.load(model_dir, args.max_model_len)
    config = model.config
    state.max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    state.backend, state.kv_cache_dtype = f"{backend.name} ({backend.dtype})", kv_type(backend)
    state.model_path, state.model_type = str(model_dir), config.model_type
    state.architectures = list(config.architectures)
    speculative = speculative_config(args)
    extra_layers = extra_kv_layers(speculative)
    draft = load_draft(speculative, backend, model, model_dir, state.tokenizer)  # before the KV cache is sized
    mirrored = draft if speculative and speculative.method == "draft_model" else None  # a draft model's own K/V
    block_bytes = pool_block_bytes(backend.ops, config, DEFAULT_BLOCK_SIZE, extra_layers, mirrored)
    state_bytes = args.max_num_seqs * KVCache.bytes_per_state_slot(config)  # a hybrid's, one per request
    graphs = backend.name == "cuda" and not args.enforce_eager and not config.delta_net
    if backend.name == "cuda" and args.kv_cache_gib is None:
        num_blocks = gpu_kv_blocks(model, args.gpu_memory_utilization, args.max_num_seqs, args.max_num_batched_tokens,
                                   state.max_model_len, extra_layers=extra_layers,
                                   graphs=graphs, draft=mirrored) - -(-state_bytes // block_bytes)
    else:  # a hybrid's state comes out of a given --kv-cache-gib, and beside the default 1 GiB of K/V
        kv_cache_gib = args.kv_cache_gib or 1.0 + state_bytes / GIB
        num_blocks = int((kv_cache_gib * GIB - state_bytes) // block_bytes)
        if num_blocks < 2:
            raise ValueError(f"--kv-cache-gib {kv_cache_gib} holds fewer than 2 KV blocks of {block_bytes} bytes"
                             + (f" beside {args.max_num_seqs} requests' state ({state_bytes / GIB:.2f} GiB)"
                                if state_bytes else ""))
    try:
        runner = ModelRunner(config, model, num_blocks, seed=args.seed, state_slots=args.max_num_seqs,
                             extra_layers=extra_layers)
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
    attach_proposer(runner, speculative, backend, model_dir, state.tokenizer, draft)
    if graphs:
        capture_graphs(runner, args.max_num_seqs, state.max_model_len)
    elif backend.name == "cuda" and config.delta_net:
        log.info("hybrid model: decoding eagerly (its state slots are not in the decode graphs yet)")
    engine = Engine(runner, state.tokenizer, EngineConfig(
        max_model_len=state.max_model_len, max_seqs=args.max_num_seqs, max_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk=args.prefill_chunk, prefill_beside_decode=prefill_beside_decode(args, backend.name),
        max_queue=args.max_queue, swap_blocks=swap_blocks, prefix_caching=args.enable_prefix_caching,
        speculative=speculative))
    state.adapters = adapters.start(engine, config, state.model_name, args)
    if state.adapters is not None:
        log.info(f"LoRA adapters: {', '.join(state.adapters.served) or 'none yet'} ({state.adapters.slots} slots of"
                 f" rank {runner.adapters.max_rank}, {runner.adapters.nbytes / 2**20:.1f} MiB)"
                 + (", loaded and unloaded at run time" if state.adapters.runtime else ""))
    log.info(f"model {model_dir} ({config.model_type}, {config.num_layers} layers), backend {backend.name}"
             f" ({backend.dtype}, weights {model.weight_bytes / 2**20:.0f} MiB),"
             f" KV cache {num_blocks} blocks x {DEFAULT_BLOCK_SIZE} tokens of {state.kv_cache_dtype} K/V"
             f" ({num_blocks * block_bytes / GIB:.2f} GiB:"
             f" {num_blocks * DEFAULT_BLOCK_SIZE / state.max_model_len:.1f} requests at full length),"
             f" max_model_len {state.max_model_len}")
    return engine


def kv_type(backend) -> str:
    """What the K/V cache holds, as the start-up line and /server_info name it."""
    if backend.ops.kv_q8_0:
        return "q8_0"
    if backend.name == "cuda":
        return "fp8_e4m3" if backend.ops.kv_fp8 else backend.dtype
    return f"float{8 * backend.ops.storage_dtype.itemsize}"


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
                             stop.wait, graceful_timeout=5.0, tls=tls_context(args), task_status=task_status)
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
        scheme = "https" if args.ssl_certfile else "http"
        log.info(f"listening on {scheme}://{args.host}:{args.port}; loading the model")
        try:
            engine = await trio.to_thread.run_sync(load_engine)
        except (ValueError, ModelError) as e:
            stop.set()
            return str(e)
        await nursery.start(engine.run)
        state.engine = engine
        log.info(f"Spool serving {state.model_name!r} on {scheme}://{args.host}:{args.port}")
    log.info("stopped")
    return None


def run_serve(args) -> int:
    configure_logging(args)
    for note in getattr(args, "peer_notes", ()):  # a peer's flag taken with no effect (app/peer_flags)
        log.warning(note)
    try:
        validate_flags(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = model_names(args)
    state = ServerState(model_name=names[0], aliases=names[1:], api_keys=api_keys(args), ui=not args.no_ui,
                        request_timeout=args.request_timeout or None, limits=limits.Limits.from_args(args),
                        responses=ResponseStore(args.responses_store_bytes, args.responses_store_ttl),
                        origins=OriginPolicy.from_args(args))
    if "*" in state.origins.origins:
        log.warning("--allowed-origins '*': any web page this machine's browsers open may call this server"
                    + ("" if state.api_keys else ", and it has no --api-key"))
    failure = trio.run(serve, state, args, functools.partial(load, args, state))
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0
