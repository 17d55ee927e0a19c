"""vLLM's and llama-server's flags, as their users copy them into `spool serve`.

Every flag of either command line (the lists beside this file, each with the version it comes
from) that Spool does not take as its own is screened before argparse sees the command line:
taken as the Spool flag of the same meaning, accepted with a note where it would change nothing
Spool does (a GPU's layer count on the CPU, a flash-attention switch where attention is always
tiled), or refused with one line that says why and what to use instead. A flag of neither list
is left to argparse, which refuses it as unrecognized; argparse never takes a prefix of a flag
(llama-server's `--draft 16` is not `--draft-model 16`).
"""

import re
from dataclasses import dataclass
from pathlib import Path

LISTS = {"vLLM": "vllm-serve.txt", "llama-server": "llama-server.txt"}
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Rule:
    pattern: str  # matches a whole flag
    action: str  # "same": Spool's flag `text`; "ignore": accepted, noted with `text`; "refuse": `text` says why
    text: str
    fine: str | None = None  # a value with which a refused flag changes nothing, and is accepted (-tp 1)


SAME, IGNORE, REFUSE = "same", "ignore", "refuse"
LORA_KEPT = "LoRA adapters are held in float32 in --max-loras slots, all usable in one step"
DRAFT = ("a draft model runs on the model's own backend, threads and cache: give it with --draft-model or"
         " --speculative-config '{\"method\": \"draft_model\", \"model\": PATH}'")
PER_REQUEST = "a request's sampling is its own: send the field in each request (temperature, top_p, seed, ...)"
ROPE = "RoPE and YaRN come from the model's own config.json or GGUF metadata"
THREADS = "numba's pool runs -t/--threads threads; pinning, priorities and NUMA placement are the OS's"
GPU_LAYERS = "every layer runs on the backend chosen (--backend cuda puts all of them on the GPU)"
ONE_DEVICE = "one process serves one device; for more, run replicas behind a router (docs/scale-out.md)"
TEXT_ONLY = "images, audio and video are not served: Spool serves text models"

# first match wins; a flag of a peer's list that no rule names is refused with its peer's name
RULES = [
    # llama-server
    Rule(r"-hf|-hfr|--hf-repo", SAME, "--model"),
    Rule(r"-to|--timeout", SAME, "--request-timeout"),
    Rule(r"--no-webui", SAME, "--no-ui"),
    Rule(r"-ngl|--gpu-layers|--n-gpu-layers", IGNORE, GPU_LAYERS),
    Rule(r"-fa|--flash-attn", IGNORE, "attention is always the tiled kernel on every backend"),
    Rule(r"--jinja", IGNORE, "chat templates are always rendered by Jinja (a sandboxed jinja2)"),
    Rule(r"--no-jinja", REFUSE, "chat templates are always rendered by Jinja; --chat-template takes another"),
    Rule(r"--embeddings?", IGNORE, "/v1/embeddings is always served beside generation"),
    Rule(r"-cb|--cont-batching", IGNORE, "batching is always continuous"),
    Rule(r"-nocb|--no-cont-batching", REFUSE, "batching is always continuous; --max-num-seqs 1 runs one request"),
    Rule(r"--metrics", IGNORE, "/metrics is always served"),
    Rule(r"-ub|--ubatch-size", IGNORE, "a step is one batch; --max-num-batched-tokens sizes it"),
    Rule(r"--mlock|--no-mmap|--mmap|--no-repack|--repack|-dio|--direct-io|--check-tensors|--no-warmup|--warmup"
         r"|--no-host|-nkvo|--no-kv-offload|-kvo|--kv-offload|--no-op-offload|--op-offload|--perf|--no-perf",
         IGNORE, "weights are memory-mapped and packed layer by layer as Spool loads them"),
    Rule(r"-tb|--threads-batch|-C|--cpu-mask|-Cr|--cpu-range|--cpu-strict|--prio|--poll|-Cb|--cpu-mask-batch|-Crb"
         r"|--cpu-range-batch|--cpu-strict-batch|--prio-batch|--poll-batch|--numa|--threads-http", IGNORE, THREADS),
    Rule(r"-sm|--split-mode|-ts|--tensor-split|-mg|--main-gpu|-dev|--device|-cmoe|--cpu-moe|-ncmoe|--n-cpu-moe"
         r"|-ot|--override-tensor|-ncffn|--n-cpu-ffn|-fit|--fit|-fitt|--fit-target|-fitc|--fit-ctx", IGNORE, GPU_LAYERS),
    Rule(r"-v|--verbose|--log-verbose|-lv|--verbosity|--log-verbosity|--log-colors|--log-prefix|--no-log-prefix"
         r"|--log-timestamps|--no-log-timestamps|--log-disable", IGNORE, "--log-level and --log-format set Spool's logs"),
    Rule(r"--slots|--no-slots|--props", IGNORE, "Spool has no /slots or /props; /metrics and /health report its state"),
    Rule(r"--cache-prompt", IGNORE, "prompt prefixes are cached in KV blocks (--enable-prefix-caching)"),
    Rule(r"--no-cache-prompt", SAME, "--no-enable-prefix-caching"),
    Rule(r"--control-vector\S*", REFUSE, "control vectors are not served; LoRA adapters are (--lora)"),
    Rule(r"--draft|--draft-max|--draft-n|--draft-min|--draft-n-min|--draft-p-min|--draft-p-split", REFUSE,
         "how many guesses a row carries is --speculative-config's num_speculative_tokens"),
    Rule(r".*-draft|.*draft.*|-md|-cd|-devd|-ngld|-td|-tbd|-Cd|-Crd|-Cbd|-Crbd|-otd|-cmoed|-ncmoed|-ctkd|-ctvd"
         r"|-hfd|-hfrd|--spec-draft-\S+", REFUSE, DRAFT),
    Rule(r"--spec-\S+", REFUSE, "speculation is --speculative-config: ngram (prompt lookup), draft_model or mtp"),
    Rule(r"--temp|--temperature|--top-k|--top-p|--min-p|--top-nsigma|--top-n-sigma|--xtc-\S+|--typical(-p)?"
         r"|--repeat-last-n|--repeat-penalty|--presence-penalty|--frequency-penalty|--dry-\S+|--adaptive-\S+"
         r"|--dynatemp-\S+|--mirostat\S*|--samplers|--sampling-seq|--sampler-seq|-l|--logit-bias|--ignore-eos"
         r"|-n|--n-predict|--predict|--grammar\S*|-j|--json-schema\S*|-jf|--backend-sampling|-bs|-r|--reverse-prompt",
         REFUSE, PER_REQUEST),
    Rule(r"--rope-\S+|--yarn-\S+", REFUSE, ROPE),
    Rule(r"--reasoning-format|--reasoning-budget|--reasoning-budget-message|--reasoning-effort|-rea|--reasoning",
         REFUSE, "thinking is read per --reasoning-parser; a request's budget and effort are its fields"),
    Rule(r"--rerank|--reranking|--pooling", REFUSE, "Spool serves generation and /v1/embeddings (last-token"
                                                    " pooling); reranking is not served"),
    Rule(r"--mmproj\S*|--no-mmproj\S*|-mm|-mmu|-mmdev|--image-\S+|--video-\S+|--media-path|--mtmd-\S+", REFUSE,
         TEXT_ONLY),
    Rule(r"-hff", SAME, "--gguf-file"),
    Rule(r"--chat-template-file", SAME, "--chat-template"),
    Rule(r"-hft|--hf-token", REFUSE, "Hub downloads read the token from HF_TOKEN in the environment"),
    Rule(r"--log-file", REFUSE, "logs go to stderr: redirect it (2> FILE)"),
    Rule(r"--log-jsonl|--no-log-jsonl", REFUSE, "--log-format json writes one JSON object a line"),
    Rule(r"--context-shift|--keep", REFUSE, "a request that reaches --max-model-len ends ('length'); its context"
                                            " is never shifted"),
    Rule(r"--no-context-shift", IGNORE, "a request's context is never shifted"),
    Rule(r"--cache-reuse|-cram|--cache-ram|--cache-idle-slots|--no-cache-idle-slots|-ctxcp|--ctx-checkpoints"
         r"|--swa-checkpoints|--checkpoint-min-step|--swa-full|-kvu|--kv-unified|-no-kvu|--no-kv-unified"
         r"|--kv-unified-per-slot|-dt|--defrag-thold|-sps|--slot-prompt-similarity|--slot-save-path",
         IGNORE, "the KV cache is paged blocks shared by every request, prefixes cached by block"),
    Rule(r"--version|--usage|--completion-bash|-cl|--cache-list|--list-devices", REFUSE,
         "`spool --version` and `spool serve --help` print what Spool is and takes"),
    Rule(r"--models-\S+|--no-models-autoload|-mu|--model-url|--docker-repo|--offline|--\S+-default|--fim-\S+"
         r"|--tags|--lazy-mode|-lzm|--load-mode|-lm", REFUSE, "Spool serves one model: give it with --model (a"
                                                           " directory, a .gguf file or a Hub id)"),
    Rule(r"--path|--api-prefix|--root-path", REFUSE, "the API is served at /v1 (and the chat page at /); a"
                                                      " reverse proxy gives it another prefix"),
    Rule(r"--ui|--webui|--ui-\S+|--webui-\S+|--no-ui-\S+|--no-webui-\S+|--tools|--tools-runtime|--agent|-ag"
         r"|--no-agent|-no-ag|--mcp-\S+", REFUSE, "the chat page at / is Spool's own (--no-ui turns it off); it"
                                                   " runs no tools"),
    Rule(r"--cors-\S+|--no-cors-credentials|--allow-credentials|--no-allow-credentials|--allowed-methods"
         r"|--allowed-headers", IGNORE, "--allowed-origins names the pages that may call the API; the API's own"
                                        " methods and headers are allowed to them"),
    # vLLM
    Rule(r"--trust-remote-code|--no-trust-remote-code", IGNORE, "Spool runs no code from a checkpoint"),
    Rule(r"--enable-chunked-prefill", IGNORE, "prefill is always chunked (--prefill-chunk)"),
    Rule(r"--no-enable-chunked-prefill", REFUSE, "prefill is always chunked; a large --prefill-chunk makes one chunk"),
    Rule(r"--disable-log-stats|--no-disable-log-stats|--enable-log-requests|--no-enable-log-requests"
         r"|--no-disable-log-requests", IGNORE, "--log-level and --disable-log-requests set Spool's logs"),
    Rule(r"-tp|--tensor-parallel-size|-pp|--pipeline-parallel-size|-dp|--data-parallel-size", REFUSE,
         ONE_DEVICE, "1"),
    Rule(r"--max-cpu-loras|--lora-dtype|--fully-sharded-loras|--no-fully-sharded-loras|--specialize-active-lora"
         r"|--no-specialize-active-lora", IGNORE, LORA_KEPT),
    Rule(r"--no-enable-lora|--disable-lora", IGNORE, "LoRA adapters are served only where --enable-lora, --lora-modules or --lora"
                                      " asks for them"),
    Rule(r"--default-mm-loras|--enable-tower-connector-lora|--disable-tower-connector-lora", REFUSE, TEXT_ONLY),
    Rule(r"--lora-target-modules", REFUSE, "an adapter adapts the modules its own files hold"),
    Rule(r"--\S*moe\S*lora\S*", REFUSE, "LoRA adapts dense projections only; a mixture of experts' are not"),
    Rule(r"--max-lora-cls-labels", REFUSE, "classification heads are not served"),
    Rule(r"-q|--quantization", REFUSE, "--dtype chooses the weights' type (q8_0, q4_k, float16 ...); a GGUF's types"
                                       " are served as they are"),
    Rule(r"--ssl-ca-certs|--ssl-cert-reqs|--ssl-ciphers", REFUSE, "clients are not asked for certificates, and the"
                                                                   " ciphers are Python's defaults for TLS 1.2 and up"),
    Rule(r"--enable-ssl-refresh|--no-enable-ssl-refresh|--disable-ssl-refresh", REFUSE,
         "the certificate is read at start: restart the server to take a renewed one"),
    Rule(r"--block-size", REFUSE, "KV blocks are 16 tokens", "16"),
    Rule(r"--enable-auto-tool-choice", IGNORE,
         "tool calls are always parsed, in the format --tool-call-parser names or the template shows"),
    Rule(r"--disable-prefix-caching", SAME, "--no-enable-prefix-caching"),
    Rule(r"--device-memory-utilization", SAME, "--gpu-memory-utilization"),
    Rule(r"--no-enforce-eager", IGNORE, "decode steps replay CUDA graphs unless --enforce-eager"),
    Rule(r"--chat-template-kwargs", REFUSE, "send chat_template_kwargs in each request"),
    Rule(r"--max-num-queued-reqs", SAME, "--max-queue"),
    Rule(r"--disable-chunked-prefill", REFUSE, "prefill is always chunked; a large --prefill-chunk makes one chunk"),
    Rule(r"--data-parallel-\S+|-dp\w|--distributed-\S+|--nnodes|--node-rank|--master-\S+|\S*expert\S*|-ep"
         r"|\S*eplb\S*|\S*nccl\S*|--ray-\S+|--no-ray-\S+|--headless\S*|-asc|--api-server-count|-dcp|-pcp"
         r"|--\S*context-parallel\S*|--dcp-\S+|--no-dcp-\S+|--cp-\S+|\S*all-reduce\S*|--all2all-backend"
         r"|--dp-\S+|--elastic-ep-\S+|--enable-elastic-ep|--disable-elastic-ep|--device-ids|--enable-scale-out"
         r"|--disable-scale-out|--cpu-distributed-timeout-seconds|--disable-hc-sp|--enable-hc-sp", REFUSE,
         ONE_DEVICE),
    Rule(r"\S*cudagraph\S*|-cc|--compilation-config|-O|--optimization-level|--performance-mode|--attention-\S+"
         r"|--\S+-backend|--kernel-config|\S*flashinfer\S*|--monokernel|--no-monokernel|--ir-op-priority"
         r"|--\S*cascade-attn|\S*dbo\S*|--enable-cumem-allocator|--disable-cumem-allocator|--jit-monitor-\S+"
         r"|--no-jit-monitor-\S+|--use-fp64-gumbel|--no-use-fp64-gumbel|--\S*shm-tensor-arena|--gdn-\S+"
         r"|--kda-\S+|--mamba-\S+|--\S+-mamba-\S+|--use-replayssm|--no-use-replayssm|--replayssm-buffer-len"
         r"|--sparse-indexer-topk-backend|--\S*hybrid-kv-cache-manager|--\S*batch-sharded-sampling",
         IGNORE, "Spool's kernels and CUDA graphs are its own (--enforce-eager decodes without graphs)"),
    Rule(r"--mm-\S+|--no-mm-\S+|--limit-mm-per-prompt|--media-io-kwargs|--allowed-local-media-path"
         r"|--allowed-media-domains|--\S*mm-embeds|--\S*chunked-mm-input|--interleave-mm-strings"
         r"|--no-interleave-mm-strings|--skip-mm-profiling|--no-skip-mm-profiling|--\S*prompt-embeds"
         r"|--language-model-only|--no-language-model-only|--trust-request-mm-kwargs|--no-trust-request-mm-kwargs",
         REFUSE, TEXT_ONLY),
    Rule(r"--\S*log-\S+|--max-log-len|--logging-\S+|--log-config-file|--otlp-\S+|--collect-detailed-traces"
         r"|--show-hidden-metrics-for-version|--disable-access-log-for-endpoints|--enable-uvicorn-access-log"
         r"|--\S*metrics\S*|--aggregate-engine-logging|--custom-histogram-buckets|--\S*layerwise-nvtx-tracing"
         r"|--\S*trace-replay|--profiler-config|--\S*server-load-tracking|--\S*logging-iteration-details",
         IGNORE, "--log-level, --log-format and --disable-log-requests set Spool's logs; /metrics is always served"),
    Rule(r"--load-format|--ignore-patterns|--safetensors-\S+|--model-loader-extra-config|--pt-load-map-location"
         r"|--\S*use-tqdm-on-load|--\S*shuffle-safetensors-files|--max-parallel-loading-workers"
         r"|--\S*checkpoint-prepare-on-startup|--fail-on-environ-validation|--no-fail-on-environ-validation",
         IGNORE, "weights are read in place, a layer at a time"),
    Rule(r"--tokenizer-mode|--tokenizer-revision|--\S*skip-tokenizer-init|--config-format|--hf-config-path"
         r"|--hf-overrides|--code-revision|--model-impl|--runner|--convert|--pooler-config|--model-class-overrides",
         REFUSE, "Spool reads the model's own config.json and tokenizer (--tokenizer names another directory)"),
    Rule(r"--scheduling-policy|--scheduler-cls|--async-scheduling|--no-async-scheduling|--long-prefill-\S+"
         r"|--no-long-prefill-\S+|--max-num-partial-prefills|--max-long-partial-prefills|--stream-interval"
         r"|--max-num-active-seqs|--max-num-scheduled-tokens|--max-num-queued-tokens|--max-num-inflight-kv-loads"
         r"|--prefill-schedule-interval|--\S*scheduler-reserve-full-isl|--cache-aware-admission-\S+"
         r"|--num-gpu-blocks-override|--kv-cache-dtype-skip-layers|--prefix-caching-hash-algo|--prefix-match-unit"
         r"|--prefix-cache-retention-interval|--\S*extensible-kv-cache|--kv-sharing-fast-prefill"
         r"|--no-kv-sharing-fast-prefill", IGNORE,
         "Spool's scheduler is strict FIFO with chunked prefill: --max-num-seqs, --max-num-batched-tokens,"
         " --prefill-chunk and --max-queue size it"),
    Rule(r"--kv-cache-memory-bytes", REFUSE, "--kv-cache-gib sizes the KV cache"),
    Rule(r"--cpu-offload-\S+|--offload-\S+|--kv-offloading-\S+|--kv-transfer-config|--kv-events-config"
         r"|--ec-\S+|--weight-transfer-config", REFUSE, "weights stay where they are loaded; --swap-space spills a"
                                                        " preempted request's K/V to the host"),
    Rule(r"--\S*sleep-mode\S*|--sleep-\S+", REFUSE, "there is no sleep mode: stop the server to free its memory"),
    Rule(r"--tool-parser-plugin|--reasoning-parser-plugin|--io-processor-plugin|--logits-processors|--worker-cls"
         r"|--worker-extension-cls|--middleware|--additional-config|--\S*-config", REFUSE,
         "Spool loads no plugins or engine configs; its flags are all it takes"),
    Rule(r"--uds|--grpc|--grpc-port", REFUSE, "Spool serves HTTP and WebSocket on --host and --port"),
    Rule(r"--disable-auto-tool-choice|--exclude-tools-when-tool-choice-none"
         r"|--no-exclude-tools-when-tool-choice-none|--tool-server|--tool-strict-level|--response-role"
         r"|--\S*return-tokens-as-token-ids|--\S*tokens-only|--chat-template-content-format|--default-chat-template-kwargs"
         r"|--trust-request-chat-template|--no-trust-request-chat-template|--max-logprobs|--logprobs-mode"
         r"|--\S*return-sampling-mask|--\S*return-routed-experts|--reasoning-effort-map|--\S*force-include-usage"
         r"|--\S*prompt-tokens-details|--\S*request-id-headers|--\S*tokenizer-info-endpoint|--\S*fastapi-docs"
         r"|--\S*offline-docs|--\S*per-request-\S+|--\S*log-deltas|--\S*log-outputs|--sse-keep-alive-interval"
         r"|--h11-\S+|--anthropic-\S+|--cohere-\S+|--no-cohere-\S+|--renderer-num-workers|--watermark\S*"
         r"|--fingerprint-\S+|--\S*sliding-window|--disable-fault-tolerance|--enable-fault-tolerance"
         r"|--\S*lora\S*|--specialize-active-lora|--no-specialize-active-lora|--numa-bind\S*|--no-numa-bind"
         r"|--swa-bounded-replay|--no-swa-bounded-replay|--engram-config|--diffusion-config|--aux-output-config"
         r"|--disable-ep-weight-filter|--disable-flash-late-interaction|--enable-flash-late-interaction",
         REFUSE, "Spool's API answers as OpenAI's and Anthropic's do; this switch of vLLM's has no counterpart"),
]


@dataclass(frozen=True)
class Flag:
    peers: tuple[str, ...]  # whose it is
    values: str  # "0", "1" or "?" (an optional value); "1" where the list does not say


def peer_flags() -> dict[str, Flag]:
    """Every flag of both lists."""
    found: dict[str, Flag] = {}
    for peer, name in LISTS.items():
        for line in (Path(__file__).parent / name).read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            row, _, values = line.partition(" ")
            for flag in row.split(","):
                held = found.get(flag)
                found[flag] = Flag((*held.peers, peer), held.values) if held else Flag((peer,), values.strip() or "1")
    return found


def rule_for(flag: str) -> Rule | None:
    return next((rule for rule in RULES if re.fullmatch(rule.pattern, flag)), None)


def screen(argv: list[str], own: set[str]) -> tuple[list[str], list[str]]:
    """(argv with each peer flag Spool does not take as its own replaced by Spool's or dropped
    with its values, a note for each dropped one). Raises ValueError with one line for a flag
    that is refused. own: the parser's option strings."""
    known = peer_flags()
    out, notes, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            out += argv[i - 1:]
            break
        name, eq, value = token.partition("=")
        if not token.startswith("-") or NEGATIVE_NUMBER.match(token) or name in own or name not in known:
            out.append(token)
            continue
        flag, rule = known[name], rule_for(name)
        whose = " and ".join(flag.peers) + "'s " + name
        if rule is None:
            raise ValueError(f"{whose} has no counterpart in Spool (spool serve --help lists its flags)")
        if rule.action == SAME:
            out.append(rule.text + eq + value)
            continue
        takes = flag.values == "1" or flag.values == "?" and i < len(argv) and not argv[i].startswith("-")
        if takes and not eq:
            value, i = (argv[i], i + 1) if i < len(argv) else ("", i)
        if rule.action == REFUSE and (rule.fine is None or value != rule.fine):
            raise ValueError(f"{whose} is not supported: {rule.text}")
        notes.append(f"{whose} is accepted and changes nothing: {rule.text}")
    return out, notes
