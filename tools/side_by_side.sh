#!/usr/bin/env bash
# Spool and llama.cpp on the same GGUF files, one after the other in one sitting (run it alone):
# llama-bench's prompt PROMPT / generation GEN against tools/bench_model.py, then streamed serving
# measured by tools/loadtest.py (INPUT_LEN random prompt tokens, OUTPUT_LEN output tokens,
# ignore_eos, greedy, closed loop; 4 requests at 1 client, 2 per client up to 32, then 1 each) at each of CLIENTS concurrent clients, Spool against llama-server. For
# Spool also its start-up (launch to a serving /health, numba's cache and the GGUF's derived files
# warm) and its peak RSS over loading and serving (GNU time). Writes OUT/NAME-*.{md,json,log,time}.
#
#   tools/side_by_side.sh LLAMA_BIN OUT FILE.gguf [FILE.gguf ...]     # LLAMA_BIN: llama.cpp's build/bin
#   CLIENTS="1 16" INPUT_LEN=64 OUTPUT_LEN=32 PROMPT=128 GEN=32 BATCHES=1,16 tools/side_by_side.sh ...  # 8B
#
# llama.cpp runs with -t 2 (this machine's cores) and 64 slots; Spool with its defaults (the
# GGUF's types kept, numba kernels). SPOOL_ENV, e.g. "NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=",
# is set for Spool's processes only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1 out=$2
shift 2
mkdir -p "$out"
port=8311
clients=${CLIENTS:-1 16 64}
input_len=${INPUT_LEN:-128} output_len=${OUTPUT_LEN:-128}
prompt=${PROMPT:-512} gen=${GEN:-128} batches=${BATCHES:-1,16,64}
spool_env=${SPOOL_ENV:-}

wait_up() {
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
        sleep 0.25
    done
    echo "the server did not come up" >&2
    return 1
}

measure() {  # NAME: one load per client count against whatever listens on $port
    for c in $clients; do
        n=$(( c == 1 ? 4 : (c > 32 ? c : 2 * c) ))
        echo "-- $1, $c clients, $n requests"
        python tools/loadtest.py --base-url "http://127.0.0.1:$port" --endpoint completions --input-len "$input_len" \
            --output-len "$output_len" --ignore-eos --max-concurrency "$c" --num-requests "$n" --seed 1 --quiet \
            --json "$out/$1-c$c.json" | grep -E "Output token throughput|Median TTFT|Median TPOT"
    done
}

for file in "$@"; do
    name=$(basename "$file" .gguf)
    echo "== $name: llama-bench"
    "$bin/llama-bench" -m "$file" -t 2 -p "$prompt" -n "$gen" -r 2 -o md | tee "$out/$name-llama-bench.md"
    echo "== $name: Spool's bench_model"
    env $spool_env python tools/bench_model.py --model "$file" --prompt-tokens "$prompt" --batches "$batches" --steps 8 \
        | tee "$out/$name-spool-bench.md"

    echo "== $name: Spool serving"
    env $spool_env python -m app serve --model "$file" --port $port > /dev/null 2>&1 &  # once: the derived files
    wait_up && kill -INT $! && wait $! || true
    started=$(date +%s.%N)
    env $spool_env /usr/bin/time -v -o "$out/$name-spool.time" python -m app serve --model "$file" --port $port \
        > "$out/$name-spool.log" 2>&1 &
    wait_up
    echo "start-up $(echo "$(date +%s.%N) - $started" | bc) s" | tee "$out/$name-spool-startup.txt"
    measure "$name-spool"
    pkill -INT -f "app serve --model $file --port $port"
    wait || true
    grep -E "Maximum resident" "$out/$name-spool.time"

    echo "== $name: llama-server"
    "$bin/llama-server" -m "$file" -t 2 --parallel 64 -c $(( 64 * (input_len + output_len + 64) )) --port $port \
        > "$out/$name-llama.log" 2>&1 &
    pid=$!
    wait_up
    measure "$name-llama"
    kill $pid
    wait $pid || true
done
