"""Which CPU path the packed-weight kernels take (avx512 or portable), and whether float16
K/V can be converted in hardware (F16C): decided once at import, every kernel module asks here.

The target is what numba compiles for, not the host: numba.config.CPU_NAME and CPU_FEATURES
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES; the host's name and features where unset, and no extra
features for `generic`, numba's setting for caches shared across machines). A feature the
features string names is as it says; the others are what LLVM gives the CPU name, read from the
assembly LLVM writes for two tiny probes, so that a kernel is compiled only where the target
lowers it and the process never aborts on a CPU Spool does not know.

- avx512: the vpmaddwd GEMV (AVX-512BW, model/quant/gemv.py) for every row count, so that a
  row's output does not depend on its batch; Q4_1 weights kept as they are.
- portable: the GEMV's walk in float32 up to GEMV_ROWS rows, OpenBLAS over widened slabs above
  (model/quant/matmul.py), for any CPU; the default --dtype there is float32, which is faster
  than them. An integer path for AVX2 CPUs is later work.

SPOOL_CPU_PATH (avx512, portable) forces a path no higher than the target allows; asking for more
logs one warning and takes the highest allowed.
"""

import logging
import os

import llvmlite.binding as llvm
from numba.core import config
from numba.core.codegen import get_host_cpu_features

log = logging.getLogger("spool.model")

PATHS = ("portable", "avx512")

CPU_NAME = config.CPU_NAME or llvm.get_host_cpu_name()
CPU_FEATURES = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
_FLAGS = {flag[1:]: flag[0] == "+" for flag in CPU_FEATURES.split(",") if flag[:1] in "+-" and flag[1:]}

# float <-> half in instructions (F16C's, or AVX512-FP16's), else calls to libgcc routines
# (__truncsfhf2, __extendhfsf2) that numba cannot link.
_F16C_PROBE = "define float @probe(float %x) {\n  %h = fptrunc float %x to half\n  %y = fpext half %h to float\n" \
              "  ret float %y\n}\n"
# 32 x i16 is one zmm register only with AVX-512BW (the width vpmaddwd's intrinsic needs).
_AVX512BW_PROBE = "define <32 x i16> @probe(<32 x i16> %a, <32 x i16> %b) #0 {\n  %c = mul <32 x i16> %a, %b\n" \
                  "  ret <32 x i16> %c\n}\nattributes #0 = { \"min-legal-vector-width\"=\"512\" }\n"


def _assembly(probe: str) -> str:
    """The assembly LLVM writes for probe on numba's target."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=CPU_NAME, features=CPU_FEATURES, opt=2)
    module = llvm.parse_assembly(probe)
    module.triple = machine.triple
    module.verify()
    return machine.emit_assembly(module)


def _target_has(feature: str, probe: str) -> bool:
    """Whether numba's target has feature: as the features string says, else as LLVM lowers probe."""
    if feature in _FLAGS:
        return _FLAGS[feature]
    assembly = _assembly(probe)
    return "zmm" in assembly if feature == "avx512bw" else not ("sfhf2" in assembly or "hfsf2" in assembly)


def _choose() -> tuple[str, str]:
    """The path and why, from the target and SPOOL_CPU_PATH."""
    allowed = "avx512" if _target_has("avx512bw", _AVX512BW_PROBE) else "portable"
    why = (f"numba's target {CPU_NAME}" + (" with NUMBA_CPU_FEATURES" if config.CPU_FEATURES else "")
           + {"avx512": " has AVX-512BW", "portable": " has no AVX-512BW"}[allowed])
    asked = os.environ.get("SPOOL_CPU_PATH", "").strip().lower()
    if not asked:
        return allowed, why
    if asked not in PATHS:
        log.warning(f"SPOOL_CPU_PATH={asked} is not one of {', '.join(PATHS)}; ignored")
        return allowed, why
    if PATHS.index(asked) > PATHS.index(allowed):
        log.warning(f"SPOOL_CPU_PATH={asked} asks for more than this CPU has ({why}); using {allowed}")
        return allowed, why
    return asked, f"SPOOL_CPU_PATH={asked}" + ("" if asked == allowed else f" (the target allows {allowed})")


PATH, WHY = _choose()
F16C = _target_has("f16c", _F16C_PROBE)
# int16 activations lose nothing measurable; int8 ones, as llama.cpp's Q8_0 dot uses, cut the
# top-1 agreement with float32 on the default model from 98.25% to 96.35%.
PMADDWD = PATH == "avx512"
log.info(f"CPU path {PATH}: {WHY}; float16 K/V {'through F16C' if F16C else 'unavailable (no F16C): float32 K/V'}")
