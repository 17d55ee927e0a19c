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
    "moe.cu": ("moe_router", "moe_topk", "moe_gemm", "moe_combine", "moe_shared_add"),
    "delta_net.cu": ("delta_conv", "delta_rule", "sigmoid_mul"),
    "lora.cu": ("lora_shrink", "lora_expand"),
    "dequant_gemv.cu": ("dequant_gemv", "dequant_rows"),
}
# fp32 logits whatever the model's storage type; moe_topk routes on the router's fp32 logits
UNTYPED = {"sample", "apply_penalties", "count_tokens", "logprobs", "moe_topk"}
# Kernels with more template arguments, and their instances. prefill_attention's (DIMS,): the
# output elements a lane accumulates, 4 up to a head_dim of 128.
VARIANTS = {"prefill_attention": ((4,), (8,), (16,))}
# the GGUF types kept packed on the device (model/ops/cuda_quant.py), the int4 blocks of AWQ and
# GPTQ checkpoints (model/quant/awq_gptq.py) and the e4m3 blocks of FP8 ones (model/quant/e4m3.py),
# each a struct of dequant_gemv.cu; dequant_gemv's last argument: 1 where it writes fp32 (logits), 0
# for the storage type
PACKED_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int4_32", "int4_128", "fp8_32", "fp8_128")
VARIANTS["dequant_gemv"] = tuple((kind.upper(), fp32) for kind in PACKED_TYPES for fp32 in (0, 1))
VARIANTS["dequant_rows"] = tuple((kind.upper(),) for kind in PACKED_TYPES)
TENSOR_CORE_TYPES = ("float16", "bfloat16")  # what WMMA multiplies
DTYPES = {"prefill_attention_tc": TENSOR_CORE_TYPES}  # kernels not instantiated for every storage type
# K/V cache types other than the storage type (--kv-cache-dtype) -> their C++ element type, a last
# template argument of the kernels that write or read a cache (common.cuh's KvCache)
CACHE_TYPES = {"fp8": "spool_fp8_e4m3"}
CACHE_KERNELS = ("write_kv", "rope_write_kv", "decode_attention", "prefill_attention", "prefill_attention_tc")
# decode_attention's (GROUP, DIMS, LANES) instances per cache rows' kind: the query heads a block
# serves, the elements of a row a lane holds and the lanes a row. A lane's row is one 16-byte load
# (8 elements of 16 bits, 4 of fp32; an fp8 row's 4 codes) up to a head_dim of 32 loads, more
# loads past it; a head_dim smaller than a shape's leaves lanes idle. GROUP as large as registers
# allow without a spill (cuda/registers.toml); a larger group goes in chunks of it.
DECODE_INSTANCES = {
    "16-bit": tuple((g, 8, lanes) for lanes in (8, 16, 32) for g in (1, 2, 4)) + ((1, 16, 32),),
    "float32": tuple((g, 4, lanes) for lanes in (16, 32) for g in (1, 2, 4, 8)) + ((1, 8, 32), (2, 8, 32), (1, 16, 32)),
    "fp8": tuple((g, 4, lanes) for lanes in (16, 32) for g in (1, 2, 4)) + ((1, 8, 32), (2, 8, 32), (1, 16, 32)),
}


def decode_rows(dtype: str, cache: str | None = None) -> str:
    """The kind of cache rows decode_attention reads: fp8 (a CACHE_TYPES key), fp32 or 16-bit."""
    return cache or ("float32" if dtype == "float32" else "16-bit")


def decode_run(dtype: str, cache: str | None = None) -> int:
    """A lane's elements a load of the decode kernel's cache rows: 16 bytes of the storage type, 4
    codes of an fp8 row (its rows are 4-byte aligned: head_dim codes, then a float32 scale)."""
    return 8 if decode_rows(dtype, cache) == "16-bit" else 4


def decode_variants(dtype: str, cache: str | None = None) -> tuple:
    return DECODE_INSTANCES[decode_rows(dtype, cache)]


def variants(kernel: str, dtype: str, cache: str | None = None) -> tuple:
    """A kernel's template instances beyond its types (None: none)."""
    if kernel == "decode_attention":
        return decode_variants(dtype, cache)
    return VARIANTS.get(kernel, (None,))


def name_expression(kernel: str, dtype: str, variant: tuple | None = None, cache: str | None = None) -> str:
    """cache: a CACHE_TYPES key, or None for K/V in the storage type."""
    if kernel in UNTYPED:
        return kernel
    extra = [CACHE_TYPES[cache]] if cache and kernel in CACHE_KERNELS else []
    return f"{kernel}<{', '.join([STORAGE_TYPES[dtype], *map(str, variant or ()), *extra])}>"


def decode_variant(group: int, head_dim: int, dtype: str, cache: str | None = None) -> tuple[int, int, int]:
    """decode_attention's (GROUP, DIMS, LANES) for a model: the first shape whose lanes cover
    head_dim, and the smallest GROUP of it that takes the whole group, else the largest (the
    group then goes in chunks of it, a block each); cache: a CACHE_TYPES key, or None."""
    run = decode_run(dtype, cache)
    if head_dim % run:
        raise ValueError(f"decode_attention reads {run} elements a load: a head_dim of {head_dim} is not a multiple")
    fits = [v for v in decode_variants(dtype, cache) if v[1] * v[2] >= head_dim]
    if not fits:
        most = max(dims * lanes for _, dims, lanes in decode_variants(dtype, cache))
        raise ValueError(f"decode_attention serves a head_dim of at most {most}, not {head_dim}")
    fits = [v for v in fits if v[1:] == fits[0][1:]]
    return next((v for v in fits if v[0] >= group), fits[-1])


def name_expressions(file: str) -> list[str]:
    plain = [name_expression(k, d, v) for k in KERNELS[file] for d in DTYPES.get(k, STORAGE_TYPES)
             for v in variants(k, d)]
    cached = [name_expression(k, d, v, c) for k in KERNELS[file] if k in CACHE_KERNELS for c in CACHE_TYPES
              for d in DTYPES.get(k, STORAGE_TYPES) for v in variants(k, d, c)]
    return list(dict.fromkeys(plain + cached))


def sources(file: str) -> list[Path]:
    """The files a kernel file's build depends on: itself and the headers it includes."""
    return [CUDA_DIR / file, CUDA_DIR / "common.cuh"]
