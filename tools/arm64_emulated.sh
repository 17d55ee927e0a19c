#!/usr/bin/env bash
# Spool's CPU kernels on 64-bit ARM without an ARM machine: an arm64 Python under qemu-user, in
# a folder of its own (no change to this machine's Python or dpkg architectures).
#
#   tools/arm64_emulated.sh setup              # once: qemu-user-static, Debian's arm64 Python 3.11,
#                                              # aarch64 wheels of numpy, numba, llvmlite, gguf (~400 MB)
#   tools/arm64_emulated.sh run SCRIPT [ARGS]  # SCRIPT under emulation, from the repository root
#
# ARM_CPU (neoverse-n1) is both the CPU QEMU emulates and numba's target: neoverse-n1 and
# cortex-a76 have the dot product (sdot), cortex-a72 has not. The two must agree: code built for
# a CPU with sdot stops with SIGILL on one without. qemu 7.2 shows the guest this machine's
# /proc/cpuinfo, so LLVM would take the CPU for `generic`; NUMBA_CPU_NAME names it instead.
# tests/test_cpu_paths.py runs the kept types' GEMV here, where this folder exists.
set -euo pipefail
ROOT=${SPOOL_ARM64_ROOT:-/tmp/spool-arm64}
cd "$(dirname "$0")/.."

setup() {
    command -v qemu-aarch64-static > /dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static > /dev/null; }
    local apt=(-oAPT::Architecture=arm64 -oAPT::Architectures=arm64 -oDir::State::Lists="$ROOT.lists")
    mkdir -p "$ROOT" "$ROOT.lists/partial" "$ROOT.debs"
    apt-get "${apt[@]}" update -qq
    (cd "$ROOT.debs" && apt-get "${apt[@]}" download -qq python3.11-minimal libpython3.11-minimal \
        libpython3.11-stdlib python3.11 libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g libexpat1 libffi8 libssl3 \
        libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libzstd1 libcrypt1 \
        libdb5.3 libgdbm6 libnsl2 libtirpc3 media-types)
    for deb in "$ROOT.debs"/*.deb; do dpkg -x "$deb" "$ROOT"; done
    python3 -m pip install -q --only-binary=:all: --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
        --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp --target "$ROOT/site" --upgrade \
        "numpy==$(python3 -c 'import numpy; print(numpy.__version__)')" \
        "numba==$(python3 -c 'import numba; print(numba.__version__)')" \
        "llvmlite==$(python3 -c 'import llvmlite; print(llvmlite.__version__)')" gguf
    run -c "import numba, numpy; print('arm64 Python', numpy.__version__, numba.__version__)"
}

run() {
    local cpu=${ARM_CPU:-neoverse-n1}
    QEMU_CPU=$cpu NUMBA_CPU_NAME=$cpu PYTHONPATH=".:$ROOT/site" NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$ROOT/numba-$cpu} \
        exec qemu-aarch64-static -L "$ROOT" "$ROOT/usr/bin/python3.11" "$@"
}

case "${1:-}" in
    setup) setup ;;
    run) shift; run "$@" ;;
    *) echo "usage: tools/arm64_emulated.sh setup | run SCRIPT [ARGS]" >&2; exit 2 ;;
esac
