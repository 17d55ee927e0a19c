"""What numba's target gives the packed-weight kernels: the widest integer vectors (avx512,
avx2 or portable) and whether float16 K/V can be converted in hardware (F16C): decided once at
import, every kernel module asks here.

The target is what numba compiles for, not the host: numba.config.CPU_NAME and CPU_FEATURES
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES; the host's name and features where unset, and no extra
features for `generic`, numba's setting for caches shared across machines). A feature the
features string names is as it says; the others are what LLVM gives the CPU name, read from the
assembly LLVM writes for tiny probes, so that nothing is compiled that the target cannot lower
and the process never aborts on a CPU Spool does not know.

The kernels are the same on every path (model/quant/gemv.py is plain vector IR that LLVM lowers
at the target's width) and so are their bits; the path decides only the default --dtype: q8_0
where the target has 256-bit integer vectors or wider (avx2, avx512), float32 through OpenBLAS
elsewhere (portable: SSE2, or a CPU not measured here), where the integer GEMV is slower. To run
another CPU's code here, set numba's own variables, e.g. NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=
for AVX2, NUMBA_CPU_NAME=generic for SSE2 (tests/test_cpu_paths.py does so).
"""

import logging

import llvmlite.binding as llvm
from numba.core import config
from numba.core.codegen import get_host_cpu_features

log = logging.getLogger("spool.model")

PATHS = ("portable", "avx2", "avx512")

CPU_NAME = config.CPU_NAME or llvm.get_host_cpu_name()
CPU_FEATURES = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
_FLAGS = {flag[1:]: flag[0] == "+" for flag in CPU_FEATURES.split(",") if flag[:1] in "+-" and flag[1:]}

# float <-> half in instructions (F16C's, or AVX512-FP16's), else calls to libgcc routines
# (__truncsfhf2, __extendhfsf2) that numba cannot link.
_F16C_PROBE = "define float @probe(float %x) {\n  %h = fptrunc float %x to half\n  %y = fpext half %h to float\n" \
              "  ret float %y\n}\n"
# 32 x i16 is one zmm register only with AVX-512BW, 16 x i16 one ymm register only with AVX2.
_VECTOR_PROBE = "define <{n} x i16> @probe(<{n} x i16> %a, <{n} x i16> %b) #0 {{\n  %c = mul <{n} x i16> %a, %b\n" \
                "  ret <{n} x i16> %c\n}}\nattributes #0 = {{ \"min-legal-vector-width\"=\"{bits}\" }}\n"
# int16 pair sums added to int32 lanes: one vpdpwssd on a zmm register only with AVX-512 VNNI,
# which brings vpdpbusd (the GEMV's) with it.
_VNNI_PROBE = """define <16 x i32> @probe(<16 x i32> %acc, <32 x i16> %a, <32 x i16> %b) #0 {
  %x = sext <32 x i16> %a to <32 x i32>
  %y = sext <32 x i16> %b to <32 x i32>
  %p = mul <32 x i32> %x, %y
  %e = shufflevector <32 x i32> %p, <32 x i32> %p, <16 x i32> <EVEN>
  %o = shufflevector <32 x i32> %p, <32 x i32> %p, <16 x i32> <ODD>
  %s = add <16 x i32> %e, %o
  %r = add <16 x i32> %acc, %s
  ret <16 x i32> %r
}
attributes #0 = { "min-legal-vector-width"="512" }
""".replace("EVEN", ", ".join(f"i32 {i}" for i in range(0, 32, 2))).replace(
    "ODD", ", ".join(f"i32 {i}" for i in range(1, 32, 2)))
_PROBES = {"avx512bw": ("zmm", _VECTOR_PROBE.format(n=32, bits=512)),
           "avx2": ("ymm", _VECTOR_PROBE.format(n=16, bits=256)),
           "avx512vnni": ("vpdpwssd\t%zmm", _VNNI_PROBE)}


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


def _target_has(feature: str) -> bool:
    """Whether numba's target has feature: as the features string says, else as LLVM lowers its probe."""
    if feature in _FLAGS:
        return _FLAGS[feature]
    if feature == "f16c":
        assembly = _assembly(_F16C_PROBE)
        return not ("sfhf2" in assembly or "hfsf2" in assembly)
    marker, probe = _PROBES[feature]
    return marker in _assembly(probe)


def _choose() -> tuple[str, str]:
    """The path and why."""
    named = " with NUMBA_CPU_FEATURES" if config.CPU_FEATURES else ""
    for path, feature, name in (("avx512", "avx512bw", "AVX-512BW"), ("avx2", "avx2", "AVX2")):
        if _target_has(feature):
            return path, f"numba's target {CPU_NAME}{named} has {name}"
    return "portable", f"numba's target {CPU_NAME}{named} has neither AVX-512BW nor AVX2"


PATH, WHY = _choose()
VNNI = PATH == "avx512" and _target_has("avx512vnni")  # the GEMV's int8 dot in one instruction
F16C = _target_has("f16c")
QUANTIZED_DEFAULT = PATH != "portable"  # the default --dtype on the CPU is q8_0, else float32
log.info(f"CPU path {PATH}: {WHY}{' and VNNI (vpdpbusd)' if VNNI else ''};"
         f" default --dtype {'q8_0' if QUANTIZED_DEFAULT else 'float32'}; float16 K/V"
         f" {'through F16C' if F16C else 'unavailable (no F16C): float32 K/V'}")
