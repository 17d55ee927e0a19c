"""Every command's flags, under the names vLLM's and llama-server's users already type.

vLLM's spelling is the primary name where Spool's differed (--max-num-seqs, not --max-seqs); the
old names stay as aliases, and llama-server's short forms are aliases where they do not clash
(-m, -c/--ctx-size, -np/--parallel, -t/--threads, -a/--alias, -b/--batch-size). Each flag is also
SPOOL_<DEST> in the environment and a key of --config FILE.yaml (app/settings.py), so this
module imports nothing heavy: --threads must be read before NumPy starts its thread pool.
"""

import argparse
import json
import re

from app.server import limits, tools
from model.choices import BACKENDS, DTYPES, KV_CACHE_TYPES

LOG_LEVELS = ("debug", "info", "warning", "error")


def name_list(text: str) -> list[str]:
    """A list as vLLM's flags take it, JSON (["http://localhost:3000"]), or comma-separated."""
    if not text.strip().startswith("["):
        return [name for name in re.split(r"[,\s]+", text.strip()) if name]
    names = json.loads(text)
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError("not a JSON list of strings")
    return names


def model_arguments(parser, *, positional: bool) -> None:
    """What picks and loads the model: shared by serve, generate and bench."""
    a = parser.add_argument
    if positional:
        a("model_arg", nargs="?", default=None, metavar="MODEL",
          help="as --model, given first as `vllm serve MODEL` takes it")
    a("-m", "--model", default=None,
      help="a Hugging Face model directory, a .gguf file, or a Hub id (Org/Name, or Org/Name:Q4_K_M for that"
           " quant of a GGUF repository) (default: SmolLM2-135M-Instruct, downloaded and converted on first use)")
    a("--gguf-file", "--hf-file", default=None, metavar="NAME",
      help="a Hub repository's GGUF file to serve, by name, when it holds several")
    a("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    a("--download-dir", default=None, metavar="DIR",
      help="where Hub downloads go (default: huggingface_hub's cache, $HF_HOME)")
    a("--tokenizer", default=None, metavar="DIR",
      help="a directory whose tokenizer (tokenizer.json, its config, its chat template) replaces the model's")
    a("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
      help="a Jinja chat template, as a file or inline, in place of the tokenizer's own")
    a("--backend", choices=BACKENDS, default="auto",
      help="numerics backend: auto picks cuda when CuPy is installed and sees a GPU, else cpu (numba kernels);"
           " numpy is the plain NumPy reference (default: auto)")
    a("--dtype", choices=DTYPES, default="auto",
      help="weights, activations and KV cache: cuda takes bfloat16, float16 or float32 (auto: bfloat16);"
           " cpu takes q8_0 weights (auto; 8-bit blocks: a quarter of the memory or less, and faster;"
           " K/V in float16), q4_k (a Hugging Face checkpoint's weights quantized to Q4_K while loading, 4.625 bits"
           " a weight; those whose rows are not a multiple of 256 as q8_0), or float32 ones (the exact path,"
           " through OpenBLAS); a GGUF's quantized tensors keep their own types whatever the dtype, so q4_k serves"
           " one as q8_0 does (default: auto)")
    a("-t", "--threads", type=int, default=None,
      help="CPU threads for the numba kernels and OpenBLAS (default: the CPUs this process may use, its affinity"
           " and cgroup quota)")


def fetch_model(args):
    """The model directory model_arguments' flags name, fetched or converted on first use."""
    from model.default import resolve_model

    return resolve_model(args.model, gguf_file=args.gguf_file, revision=args.revision, download_dir=args.download_dir)


def prefill_beside_decode(args, backend: str) -> int:
    """On the CPU a step's time grows with its prompt tokens, so beside decoding streams a step
    takes half a chunk: a 20k-token prompt beside 4 streams reached its first token 6% later
    and the streams' TPOT halved (BENCHMARKS.md). On a GPU (not measured yet) a whole chunk."""
    if args.prefill_beside_decode is not None:
        return args.prefill_beside_decode
    return 0 if backend == "cuda" else 128


def speculative_config(args):
    """--speculative-config's JSON and --draft-model, parsed (a ValueError of one line when
    they cannot be); None when neither is given."""
    if not (args.speculative_config or args.draft_model):
        return None
    from app.engine.speculation import SpeculativeConfig

    return SpeculativeConfig.parse(args.speculative_config, args.draft_model)


def kv_cache_type(args) -> str:
    """The K/V cache's type from llama-server's --cache-type-k/-v and vLLM's --kv-cache-dtype:
    f16, q8_0 or fp8, or a ValueError of one line that says what works."""
    works = ("K/V is f16, q8_0 on the CPU (--cache-type-k q8_0 --cache-type-v q8_0), or fp8 on CUDA"
             " (--kv-cache-dtype fp8)")
    if args.kv_cache_dtype in ("fp8", "fp8_e4m3"):
        if args.backend in ("cpu", "numpy"):
            raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is --backend cuda's; on the CPU,"
                             " --cache-type-k q8_0 --cache-type-v q8_0 quantizes K/V")
        if (args.cache_type_k, args.cache_type_v) != ("f16", "f16"):
            raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} with --cache-type-k {args.cache_type_k}"
                             f" --cache-type-v {args.cache_type_v}: give one of them")
        return "fp8"
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not built (auto keeps K/V in the --dtype's"
                         " float, fp8 or fp8_e4m3 in e4m3 with a scale per token and head); " + works)
    for flag, kind in (("--cache-type-k", args.cache_type_k), ("--cache-type-v", args.cache_type_v)):
        if kind not in KV_CACHE_TYPES or kind == "fp8":  # llama-server's types; fp8 is vLLM's flag's
            raise ValueError(f"{flag} {kind} is not built; {works}")
    if args.cache_type_k != args.cache_type_v:
        raise ValueError(f"--cache-type-k {args.cache_type_k} with --cache-type-v {args.cache_type_v}: K and V are"
                         " kept alike; give both q8_0 or both f16")
    return args.cache_type_k


def extra_kv_layers(speculative) -> int:
    """Attention layers the KV cache holds beyond the model's: the MTP layer's (model/mtp.py)."""
    return 1 if speculative and speculative.method == "mtp" else 0


def load_draft(speculative, backend, model, model_dir, tokenizer):
    """A proposer's weights, on the device before the KV cache is sized so the memory plan
    measures them (model/memory.py): a draft model's (--speculative-config method
    "draft_model"; its K/V then shares each block of the pool) or the model's MTP layer's (its
    K/V is extra_kv_layers'); None for the others."""
    if speculative and speculative.method == "draft_model":
        from model.default import resolve_model
        from model.draft import DraftModel

        return DraftModel.load_model(backend, resolve_model(speculative.model), model.config, tokenizer)
    if speculative and speculative.method == "mtp":
        from model.mtp import MTP

        return MTP.load_weights(model_dir, model)
    return None


def attach_proposer(runner, speculative, backend, model_dir, tokenizer, draft=None) -> None:
    """The runner's guesses for speculation's rows: a draft model's or the model's MTP layer's
    (prompt lookup's are the planner's); draft: their weights from load_draft, or loaded now."""
    if speculative and speculative.method == "draft_model":
        from model.default import resolve_model
        from model.draft import DraftModel

        runner.draft = (DraftModel.over(draft, runner) if draft is not None else
                        DraftModel.load(backend, resolve_model(speculative.model), runner, tokenizer))
    elif speculative and speculative.method == "mtp":
        from model.mtp import MTP

        runner.draft = MTP.load(model_dir, runner, speculative.num_speculative_tokens, draft)


def engine_arguments(parser) -> None:
    """How many requests run at once and what a step holds: shared by serve and bench."""
    a = parser.add_argument
    a("--max-num-seqs", "--max-seqs", "-np", "--parallel", dest="max_num_seqs", type=int, default=64,
      help="most requests running at once (default: 64)")
    a("--max-num-batched-tokens", "--max-batched-tokens", "-b", "--batch-size", dest="max_num_batched_tokens",
      type=int, default=1024, help="most tokens per step, decode rows included (default: 1024)")
    a("--max-model-len", "-c", "--ctx-size", dest="max_model_len", type=int, default=None,
      help="context length, prompt plus output (default: the model's)")
    a("--prefill-chunk", type=int, default=256,
      help="most prompt tokens prefilled per step (beside decoding streams, --prefill-beside-decode) (default: 256)")
    a("--prefill-beside-decode", type=int, default=None,
      help="prompt tokens per step while other requests decode, counted as at a prompt's start (deeper chunks hold"
           " fewer, at least 16), so a long prompt stalls running streams less (default: 128 on the CPU, where a"
           " step's time grows with its tokens; on a GPU, --prefill-chunk)")
    a("--kv-cache-gib", type=float, default=None,
      help="memory for the paged KV cache in GiB (default: 1.0 on the CPU; on a GPU, what --gpu-memory-utilization"
           " leaves)")
    a("--gpu-memory-utilization", type=float, default=0.9,
      help="CUDA: share of the GPU's memory for the weights, a step's activations and the KV cache; the KV cache"
           " gets what the other two leave, measured by a profiling step at start-up (default: 0.9)")
    a("--enforce-eager", action="store_true",
      help="CUDA: run decode steps kernel by kernel instead of replaying CUDA graphs captured at start-up")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
      help="reuse the KV blocks of prompts' shared prefixes (default: on)")
    a("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS)
    a("--speculative-config", default=None, metavar="JSON",
      help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4,'
           ' "prompt_lookup_max": 4, "prompt_lookup_min": 2} for prompt lookup, {"method": "draft_model",'
           ' "model": PATH, "num_speculative_tokens": 4} for a draft model (the CPU backends), or {"method": "mtp",'
           ' "num_speculative_tokens": 1} for the model\'s own multi-token-prediction layer (Qwen3.5) (default: off)')
    a("--cache-type-k", "-ctk", default="f16", metavar="TYPE",
      help="the K cache's type, as llama-server takes it: f16 (the --dtype's float: float16 on the CPU) or q8_0"
           " (the CPU backend beside q8_0 or q4_k weights: 8 bits and a scale per token and head, about 1.9 times"
           " the tokens in the same --kv-cache-gib); K and V are kept alike (default: f16)")
    a("--cache-type-v", "-ctv", default="f16", metavar="TYPE",
      help="the V cache's type: as --cache-type-k's (default: f16)")
    a("--kv-cache-dtype", default="auto", metavar="auto",
      help="vLLM's K/V type: auto, the --dtype's float; or fp8 (fp8_e4m3), --backend cuda's: e4m3 values and a"
           " float32 scale per token and head, about 1.9 times the tokens of bfloat16 K/V in the same memory (on"
           " the CPU, --cache-type-k q8_0 --cache-type-v q8_0 quantizes K/V) (default: auto)")
    a("--draft-model", "-md", "--model-draft", dest="draft_model", default=None, metavar="MODEL",
      help="a smaller model with the same tokenizer whose guesses the model verifies (as --speculative-config's"
           " draft_model; a path or Hub id)")


def serve_arguments(parser) -> None:
    model_arguments(parser, positional=True)
    engine_arguments(parser)
    a = parser.add_argument
    a("--enable-lora", action="store_true",
      help="serve LoRA adapters, as vLLM does: those of --lora-modules, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"
           " in the environment, those POSTed to /v1/load_lora_adapter")
    a("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
      help='LoRA adapters a request chooses by naming one as its model: NAME=PATH or vLLM\'s JSON ({"name": ...,'
           ' "path": ...}); PATH a PEFT adapter\'s directory or a GGUF adapter (default: none)')
    a("--max-loras", type=int, default=1,
      help="LoRA adapters held at once (at least those given at start), all of them usable in one step (default: 1)")
    a("--max-lora-rank", type=int, default=16,
      help="the highest rank an adapter may have (at least that of those given at start) (default: 16)")
    a("--lora", action="append", default=None, metavar="FILE",
      help="llama-server's: a LoRA adapter (a GGUF file or a PEFT directory) applied to every request that chooses"
           " none; requests choose by its file name as the model, or llama-server's lora field (default: none)")
    a("--lora-scaled", nargs=2, action="append", default=None, metavar=("FILE", "SCALE"),
      help="llama-server's: --lora at a scale")
    a("--lora-init-without-apply", action="store_true",
      help="llama-server's: load the --lora adapters at scale 0, applied only where a request chooses one")
    a("--served-model-name", "-a", "--alias", dest="served_model_name", nargs="+", default=None, metavar="NAME",
      help="the names clients use, the first in replies (default: the Hub id, or the directory's or file's name)")
    a("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    a("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    a("--swap-space", type=float, default=0.0,
      help="host memory in GiB to spill preempted requests' KV to (pinned on a GPU, copied on a side stream),"
           " and the prefix cache's blocks evicted from the KV cache (reloaded when a prompt reuses them);"
           " 0 re-prefills them instead (default: 0)")
    a("--max-queue", type=int, default=1024,
      help="most requests waiting; more get HTTP 429, and one request with more choices (prompts x n) than this"
           " gets 400 (default: 1024)")
    a("--api-key", nargs="+", default=None, metavar="KEY",
      help="require one of these keys as 'Authorization: Bearer KEY' (or x-api-key) on every route but /health;"
           " several are space-separated (in SPOOL_API_KEY, comma-separated too), and what one key stores in the"
           " Responses store only that key reads (default: none)")
    a("--ssl-certfile", "--ssl-cert-file", dest="ssl_certfile", default=None, metavar="FILE",
      help="serve HTTPS (and wss://) with this PEM certificate chain, beside --ssl-keyfile (default: plain HTTP)")
    a("--ssl-keyfile", "--ssl-key-file", dest="ssl_keyfile", default=None, metavar="FILE",
      help="the certificate's PEM private key (default: in --ssl-certfile)")
    a("--api-key-file", default=None, metavar="FILE",
      help="--api-key's keys from a file, one a line (as llama-server takes them) (default: none)")
    a("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
      help="where a request's sampling defaults come from when it leaves temperature, top_p, top_k, min_p,"
           " repetition_penalty or max_tokens out, as vLLM takes it: auto, the model's generation_config.json; vllm,"
           " none (OpenAI's defaults); or a folder's generation_config.json (default: auto)")
    a("--override-generation-config", default=None, metavar="JSON",
      help='sampling defaults over --generation-config\'s, as a JSON object ({"temperature": 0.6}) (default: none)')
    a("--seed", "-s", type=int, default=None,
      help="seed of the draws of requests that send no seed of their own, so a server's unseeded output"
           " repeats from start to start as vLLM's does (default: none, fresh each start)")
    a("--allowed-origins", type=name_list, default=None, metavar="JSON_LIST",
      help='web pages besides the server\'s own that may call it from a browser, as origins in a JSON list'
           ' (\'["http://localhost:3000"]\', as vLLM takes it) or comma-separated; they get CORS headers; "*" is'
           ' any page (default: none)')
    a("--allowed-hosts", type=name_list, default=None, metavar="JSON_LIST",
      help="names the Host header may carry, ports aside, against DNS rebinding; \"*\" is any (default: localhost,"
           " 127.0.0.1 and [::1] when --host is a loopback address, else any)")
    a("--request-timeout", type=float, default=600.0, help="seconds a request may take; 0: no limit (default: 600)")
    a("--shutdown-timeout", type=float, default=30.0,
      help="seconds in-flight requests get to finish after SIGINT/SIGTERM (default: 30)")
    a("--tool-call-parser", default=None, metavar="NAME",
      help=f"how the model writes tool calls, by vLLM's parser names: {', '.join(tools.FORMATS)}"
           " (default: read from the chat template's markers, else hermes)")
    a("--reasoning-parser", default=None, metavar="NAME",
      help="how the model writes its thinking, returned as reasoning_content, by vLLM's parser names: deepseek_r1,"
           " qwen3 and mistral (think tags: <think>, [THINK] or <mm:think>), openai_gptoss (GPT-OSS's harmony"
           " analysis channel), and kimi_k3 (Kimi K3's XTML think section) (default: openai_gptoss"
           " where the chat template writes an analysis channel, kimi_k3 where it writes XTML, else think tags"
           " where they are tokens of the vocabulary)")
    a("--responses-store-ttl", type=float, default=limits.STORE_TTL, metavar="SECONDS",
      help="seconds a stored Response stays readable (previous_response_id, GET) after it is made: long enough"
           " for the next turns of a chat or an agent's loop, short enough that conversations do not sit in memory"
           f" all day; the store is memory and a restart empties it anyway (default: {limits.STORE_TTL:g})")
    a("--responses-store-bytes", type=int, default=limits.STORE_BYTES, metavar="BYTES",
      help="most bytes of stored Responses (as JSON, with the conversation each continues) held in memory;"
           f" past it the least recently used go first (default: {limits.STORE_BYTES}, {limits.STORE_BYTES >> 20} MiB)")
    a("--no-ui", action="store_true", help="do not serve the chat page at /")
    a("--log-level", default="info", choices=LOG_LEVELS, help="(default: info)")
    a("--log-format", default="text", choices=("text", "json"),
      help="text lines, or one JSON object a line for log shippers (default: text)")
    a("--disable-log-requests", "--disable-uvicorn-access-log", dest="disable_log_requests", action="store_true",
      help="no log line per request")
    a("--uvicorn-log-level", default=None, choices=LOG_LEVELS,
      help="level of the HTTP layer's own logs: request lines, connections (default: --log-level)")
    limits.add_arguments(parser)


def generate_arguments(parser) -> None:
    parser.add_argument("prompt", help="the user message")
    model_arguments(parser, positional=False)
    a = parser.add_argument
    a("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    a("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    a("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    a("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")


def bench_arguments(parser) -> None:
    model_arguments(parser, positional=True)
    engine_arguments(parser)
    a = parser.add_argument
    a("--num-prompts", type=int, default=64, help="requests, all submitted at once (default: 64)")
    a("--input-len", type=int, default=128, help="prompt tokens of each, random ids (default: 128)")
    a("--output-len", type=int, default=64, help="tokens each generates, never stopping early (default: 64)")
