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
    "lora.cu": ("lora_shrink", "lora_expand"),
}
# fp32 logits whatever the model's storage type; moe_align sorts integers
UNTYPED = {"sample", "apply_penalties", "count_tokens", "logprobs", "moe_align"}
# Kernels with more template arguments, and their instances: decode attention's (GROUP, DIMS) size
# its per-thread arrays for the query heads a block serves and the elements of a row a lane holds
# (no GROUP 8 at DIMS 8: its 128 floats of queries and accumulators spill; at DIMS 16 GROUP 1
# alone: fp32's GROUP 2 spills).
# prefill_attention's (DIMS,): the output elements a lane accumulates, 4 up to a head_dim of 128.
VARIANTS = {"decode_attention": ((1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (4, 8), (1, 16)),
            "prefill_attention": ((4,), (8,), (16,))}
TENSOR_CORE_TYPES = ("float16", "bfloat16")  # what WMMA multiplies
DTYPES = {"prefill_attention_tc": TENSOR_CORE_TYPES}  # kernels not instantiated for every storage type


def name_expression(kernel: str, dtype: str, variant: tuple | None = None) -> str:
    if kernel in UNTYPED:
        return kernel
    return f"{kernel}<{', '.join([STORAGE_TYPES[dtype], *map(str, variant or ())])}>"


def decode_variant(group: int, head_dim: int) -> tuple[int, int]:
    """decode_attention's (GROUP, DIMS) for a model: the fewest elements a lane that cover head_dim
    in a warp, and the smallest GROUP of those that takes the whole group, else the largest (the
    group then goes in chunks of it, a block each)."""
    fits = [v for v in VARIANTS["decode_attention"] if 32 * v[1] >= head_dim]
    if not fits:
        raise ValueError(f"decode_attention serves a head_dim of at most {32 * VARIANTS['decode_attention'][-1][1]},"
                         f" not {head_dim}")
    fits = [v for v in fits if v[1] == fits[0][1]]
    return next((v for v in fits if v[0] >= group), fits[-1])


def name_expressions(file: str) -> list[str]:
    return list(dict.fromkeys(name_expression(k, d, v) for k in KERNELS[file] for d in DTYPES.get(k, STORAGE_TYPES)
                              for v in VARIANTS.get(k, (None,))))


def sources(file: str) -> list[Path]:
    """The files a kernel file's build depends on: itself and the headers it includes."""
    return [CUDA_DIR / file, CUDA_DIR / "common.cuh"]
