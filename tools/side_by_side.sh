#!/usr/bin/env bash
# Spool and llama.cpp's llama-server on the same machine, one after the other in one sitting,
# measured by tools/loadtest.py with the same streamed chat workload (about 106 prompt tokens,
# 128 output tokens, ignore_eos, greedy) at concurrency 1, 16 and 64. Writes OUT/NAME-cC.json
# and OUT/side-by-side-c64.png.
#
#   tools/side_by_side.sh path/to/llama-server q4_1.gguf f32.gguf OUT
#
# llama-server runs with 2 threads and 64 slots; Spool with its defaults (q8_0 weights, numba
# kernels) and with --dtype float32, and OpenBLAS free to pick its own kernels (FIELD-NOTES: the
# environment pins Haswell for CI).
set -euo pipefail
cd "$(dirname "$0")/.."
server=$1 q4=$2 f32=$3 out=$4
mkdir -p "$out"
port=8311

wait_up() {
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
        sleep 0.5
    done
    echo "the server did not come up" >&2
    return 1
}

measure() {  # NAME: three loads against whatever listens on $port
    for c in 1 16 64; do
        n=$(( c == 1 ? 8 : 2 * c ))
        python tools/loadtest.py --base-url "http://127.0.0.1:$port" --endpoint chat --input-len 76 \
            --output-len 128 --ignore-eos --max-concurrency "$c" --num-requests "$n" --seed 1 --quiet \
            --json "$out/$1-c$c.json" | grep -E "Output token throughput|Median TTFT|Median TPOT"
    done
}

for name in spool spool-float32 llama-f32 llama-q4_1; do
    echo "== $name"
    case $name in
        spool) env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m app serve --port $port > "$out/$name.log" 2>&1 & ;;
        spool-float32) env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m app serve --port $port --dtype float32 \
            > "$out/$name.log" 2>&1 & ;;
        llama-f32) "$server" -m "$f32" -t 2 --parallel 64 -c 65536 -ub 512 --port $port --metrics \
            --alias SmolLM2-135M-Instruct > "$out/$name.log" 2>&1 & ;;
        llama-q4_1) "$server" -m "$q4" -t 2 --parallel 64 -c 65536 -ub 512 --port $port --metrics \
            --alias SmolLM2-135M-Instruct > "$out/$name.log" 2>&1 & ;;
    esac
    pid=$!
    wait_up
    measure $name
    kill $pid
    wait $pid || true
done
python tools/loadtest.py --compare "$out"/spool-c64.json "$out"/spool-float32-c64.json "$out"/llama-f32-c64.json "$out"/llama-q4_1-c64.json \
    --plot "$out/side-by-side-c64.png"
