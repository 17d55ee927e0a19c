"""The CUDA kernels: which .cu file holds which kernels, and where the files are. A kernel is a
template over its storage type; CuPy names each instance by a C++ name expression such as
`rms_norm<__nv_bfloat16>`. The GPU launcher and the CPU harness (tests/cuda_harness.py) both
build from this list, so what CI tests is what the GPU runs."""

from pathlib import Path

# In a checkout the files are the repository's cuda/; an installed wheel carries them as model/cuda.
_INSTALLED = Path(__file__).resolve().parents[1] / "cuda"
CUDA_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parents[2] / "cuda"
SHIM_DIR = CUDA_DIR / "shim"

# NumPy dtype name -> the C++ storage type kernels are instantiated with.
STORAGE_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

KERNELS = {
    "rms_norm.cu": ("rms_norm", "add_rms_norm"),
    "activation.cu": ("silu_and_mul", "gelu_and_mul", "clamped_swiglu"),
    "embedding.cu": ("embedding",),
    "rotary.cu": ("rotary", "scale_tokens"),
    "kv_write.cu": ("write_kv", "rope_write_kv"),
    "decode_attention.cu": ("decode_attention", "decode_attention_reduce"),
    "prefill_attention.cu": ("prefill_attention",),
    "prefill_attention_tc.cu": ("prefill_attention_tc",),
    "sampling.cu": ("sample",),
    "penalties.cu": ("apply_penalties", "count_tokens"),
    "logprobs.cu": ("logprobs",),
    "moe.cu": ("moe_route", "moe_align", "moe_gemm", "moe_combine", "moe_shared_add"),
    "delta_net.cu": ("delta_conv", "delta_rule", "sigmoid_mul"),
}
# fp32 logits whatever the model's storage type; moe_align sorts integers
UNTYPED = {"sample", "apply_penalties", "count_tokens", "logprobs", "moe_align"}
# Kernels with a second template argument, and its instances: decode attention's GROUP sizes its
# per-thread arrays for the query heads a KV head serves (the smallest instance >= the model's).
VARIANTS = {"decode_attention": (1, 2, 4, 8)}
TENSOR_CORE_TYPES = ("float16", "bfloat16")  # what WMMA multiplies
DTYPES = {"prefill_attention_tc": TENSOR_CORE_TYPES}  # kernels not instantiated for every storage type


def name_expression(kernel: str, dtype: str, variant: int | None = None) -> str:
    if kernel in UNTYPED:
        return kernel
    return f"{kernel}<{STORAGE_TYPES[dtype]}>" if variant is None else f"{kernel}<{STORAGE_TYPES[dtype]}, {variant}>"


def variant(kernel: str, at_least: int) -> int:
    """The smallest instance of kernel's second template argument that is at least at_least."""
    fits = [v for v in VARIANTS[kernel] if v >= at_least]
    if not fits:
        raise ValueError(f"{kernel} serves at most {VARIANTS[kernel][-1]} query heads per KV head, not {at_least}")
    return fits[0]


def name_expressions(file: str) -> list[str]:
    return list(dict.fromkeys(name_expression(k, d, v) for k in KERNELS[file] for d in DTYPES.get(k, STORAGE_TYPES)
                              for v in VARIANTS.get(k, (None,))))


def sources(file: str) -> list[Path]:
    """The files a kernel file's build depends on: itself and the headers it includes."""
    return [CUDA_DIR / file, CUDA_DIR / "common.cuh"]
