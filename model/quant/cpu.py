"""What numba's target gives the packed-weight kernels: the widest integer vectors on x86 (avx512,
avx2 or portable) or 64-bit ARM (neon), the widest vpdpbusd (VNNI), ARM's sdot, and whether
float16 K/V can be converted in hardware (F16C, or ARM's own): decided once at import, every
kernel module asks here.

The target is what numba compiles for, not the host: numba.config.CPU_NAME and CPU_FEATURES
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES; the host's name and features where unset, and no extra
features for `generic`, numba's setting for caches shared across machines). A feature the
features string names is as it says; the others are what LLVM gives the CPU name, read from the
assembly LLVM writes for tiny probes, so that nothing is compiled that the target cannot lower
and the process never aborts on a CPU Spool does not know.

The GEMV's integer sums are exact on every path (model/quant/gemv.py: vpdpbusd with VNNI,
pmaddubsw on AVX2 and AVX-512BW, sdot on ARM with the dot product, plain vector IR elsewhere),
so its bits are the same on all of them; the path decides only the instructions. The default
--dtype is q8_0 on every path: on numba's generic SSE2 target the packed GEMV still decodes 2-4x
faster than float32 weights through OpenBLAS (BENCHMARKS.md, "Packed weights on every CPU"). To
run another CPU's code here, set numba's own variables, e.g. NUMBA_CPU_NAME=haswell
NUMBA_CPU_FEATURES= for AVX2, NUMBA_CPU_NAME=generic for SSE2 (tests/test_cpu_paths.py does so);
tools/arm64_emulated.sh runs ARM's under QEMU.
"""

import ctypes
import logging
import platform

import llvmlite.binding as llvm
from numba.core import config
from numba.core.codegen import get_host_cpu_features

log = logging.getLogger("spool.model")

PATHS = ("portable", "avx2", "avx512", "neon")  # x86's by width; neon: 64-bit ARM (plain IR, sdot)

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
# n int16 pair sums added to int32 lanes: one vpdpwssd only with VNNI (AVX-512 VNNI on a zmm
# register, AVX-VNNI's on a ymm one), which brings vpdpbusd (the GEMV's) with it.
_VNNI_PROBE = """define <{h} x i32> @probe(<{h} x i32> %acc, <{n} x i16> %a, <{n} x i16> %b) #0 {{
  %x = sext <{n} x i16> %a to <{n} x i32>
  %y = sext <{n} x i16> %b to <{n} x i32>
  %p = mul <{n} x i32> %x, %y
  %e = shufflevector <{n} x i32> %p, <{n} x i32> %p, <{h} x i32> <{even}>
  %o = shufflevector <{n} x i32> %p, <{n} x i32> %p, <{h} x i32> <{odd}>
  %s = add <{h} x i32> %e, %o
  %r = add <{h} x i32> %acc, %s
  ret <{h} x i32> %r
}}
attributes #0 = {{ "min-legal-vector-width"="{bits}" }}
"""


def _vnni_probe(n: int) -> str:
    lanes = (", ".join(f"i32 {i}" for i in range(first, n, 2)) for first in (0, 1))
    return _VNNI_PROBE.format(n=n, h=n // 2, even=next(lanes), odd=next(lanes), bits=16 * n)


# 16 int8 products summed in fours into 4 int32 lanes: one sdot only with ARM's dot product
# (FEAT_DotProd: Apple M1 and later, Graviton 2 and later, Neoverse, Cortex-A76 and later). A
# generic intrinsic, so a target without it expands it rather than failing; only the probe uses
# it, since it leaves which products share a lane to the target (sdot's are adjacent fours).
_SDOT_PROBE = """define <4 x i32> @probe(<4 x i32> %acc, <16 x i8> %a, <16 x i8> %b) {
  %x = sext <16 x i8> %a to <16 x i32>
  %y = sext <16 x i8> %b to <16 x i32>
  %p = mul <16 x i32> %x, %y
  %r = call <4 x i32> @llvm.vector.partial.reduce.add.v4i32.v16i32(<4 x i32> %acc, <16 x i32> %p)
  ret <4 x i32> %r
}
declare <4 x i32> @llvm.vector.partial.reduce.add.v4i32.v16i32(<4 x i32>, <16 x i32>)
"""

_PROBES = {"avx512bw": ("zmm", _VECTOR_PROBE.format(n=32, bits=512)),
           "avx2": ("ymm", _VECTOR_PROBE.format(n=16, bits=256)),
           "avx512vnni": ("vpdpwssd\t%zmm", _vnni_probe(32)),
           "avxvnni": ("vpdpwssd\t%ymm", _vnni_probe(16)),
           "dotprod": ("sdot\t", _SDOT_PROBE)}


def _assembly(probe: str, triple: str = "", name: str = CPU_NAME, features: str = CPU_FEATURES) -> str:
    """The assembly LLVM writes for probe on numba's target (or on the triple's named CPU, which
    tests/test_cpu_paths.py asks of ARM's on this machine)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_triple(triple) if triple else llvm.Target.from_default_triple()
    machine = target.create_target_machine(cpu=name, features=features, opt=2)
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
    if ARM:
        return "neon", f"numba's target {CPU_NAME}{named} is 64-bit ARM"
    for path, feature, name in (("avx512", "avx512bw", "AVX-512BW"), ("avx2", "avx2", "AVX2")):
        if _target_has(feature):
            return path, f"numba's target {CPU_NAME}{named} has {name}"
    return "portable", f"numba's target {CPU_NAME}{named} has neither AVX-512BW nor AVX2"


ARM = llvm.get_process_triple().startswith(("aarch64", "arm64"))
PATH, WHY = _choose()
# the bits of the registers vpdpbusd (the GEMV's int8 dot, 64 or 32 products) works on: 512
# with AVX-512 VNNI, 256 with AVX-VNNI (Alder Lake and later), else 0
VNNI = (512 if PATH == "avx512" and _target_has("avx512vnni") else
        256 if PATH == "avx2" and _target_has("avxvnni") else 0)
# int8 dot products into int32 lanes by sdot (16 products an instruction) on ARM where the
# target has them, else the plain IR's widening multiplies
SDOT = ARM and _target_has("dotprod")
F16C = _target_has("f16c")


def _tiles_granted() -> bool:
    """Whether Linux lets this process use AMX's tile registers: their 8 KB of state is granted to
    a process only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18); a
    tile instruction without it is a SIGILL."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    arch_prctl, request_permission, tile_data = 158, 0x1023, 18
    return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, request_permission, tile_data) == 0


# AMX's int8 tiles (Sapphire Rapids and later): gemv.py multiplies 16 activation rows by a
# strip's block in one tdpbsud. Only where the features string names them (the host's, unless
# NUMBA_CPU_FEATURES says otherwise; LLVM aborts on a tile instruction it cannot select, so no
# probe) and the kernel grants the tile state.
AMX = VNNI == 512 and _FLAGS.get("amx-tile", False) and _FLAGS.get("amx-int8", False) and _tiles_granted()
log.info(f"CPU path {PATH}: {WHY}{f' and {VNNI}-bit VNNI (vpdpbusd)' if VNNI else ''}"
         f"{' and AMX int8 tiles' if AMX else ''}{' and the dot product (sdot)' if SDOT else ''}; float16 K/V"
         f" {'through F16C' if F16C else 'unavailable (no F16C): float32 K/V'}")
