"""--backend and --dtype, resolved once per process to the ops (model/ops/protocol.py) of
model/llama.py.

cpu: numba kernels (NumbaOps, model/ops/numba_ops.py), with Q8_0 8-bit weights (model/quant/; a
quarter of the memory, and one integer GEMV for every batch size on every CPU, so that a row's
logits do not depend on its batch; a GGUF's tensors packed from their own blocks
(model/quant/blocks.py), every kept type exact), or Q4_K ones for the float weights of rows of
256 and up (--dtype q4_k: 4.625 bits a weight; a GGUF's quantized tensors keep their own types),
unless --dtype float32 asks for float32 ones, multiplied by OpenBLAS; by default q8_0 on every
CPU (model/quant/cpu.py picks its instructions). numpy: NumPy alone in float32, the
reference the others are tested against. cuda: Spool's kernels through CuPy, in float16 when
the checkpoint says it was trained in float16, else bfloat16, unless --dtype says otherwise.
auto: cuda when CuPy is installed and sees a device, else cpu. Every refusal is a ValueError of one
line that says what to do instead.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from model.choices import CPU_DTYPES, KV_CACHE_TYPES
from model.config import ModelConfig
from model.errors import one_line
from model.llama import Llama
from model.ops.numpy_ops import NumpyOps
from model.ops.protocol import Ops
from model.runner import load_model
from model.weights import open_tensors

log = logging.getLogger("spool.model")

# What the attention kernels hold in registers and shared memory (cuda/decode_attention.cu,
# prefill_attention*.cu); any number of query heads per KV head (decode takes them in chunks).
CUDA_MAX_HEAD_DIM = 512


@dataclass
class Backend:
    name: str  # cpu or cuda
    dtype: str  # of weights, activations and K/V; auto until a model is loaded
    ops: Ops | None = None  # set by prepare: once the dtype is known, and the model checked
    kv: str = "f16"  # the K/V cache's type: f16 (the dtype's), q8_0 (the CPU's, beside packed weights) or fp8 (CUDA's)

    def load(self, model_dir: Path, max_model_len: int | None = None, progress: bool | None = None) -> Llama:
        """The model's weights on this backend, after check_model; progress: a bar on stderr
        (None: only when stderr is a terminal). A model refused by its config.json or its tensor
        headers is refused before the CPU kernels compile (tens of seconds on a cold cache)."""
        config = ModelConfig.load(Path(model_dir))
        open_tensors(Path(model_dir))  # reads the headers only: FP8 or packed-integer tensors refused by name
        self.prepare(config)
        try:
            return load_model(model_dir, self.ops, max_model_len, progress)
        except MemoryError as e:  # CuPy's OutOfMemoryError is one
            raise ValueError(f"the weights do not fit in memory ({one_line(e)}); serve a smaller model or a narrower"
                             " --dtype (bfloat16 rather than float32)") from None

    def prepare(self, config: ModelConfig) -> Ops:
        """check_model, then the ops for the config's dtype (CUDA decides it only now); returns them."""
        check_model(self, config)
        if self.ops is None and self.name == "cpu":
            self.ops = cpu_kernels()(self.dtype, cpu_activations(config), self.kv)
        if self.ops is None:
            from model.ops import cupy_ops

            if self.dtype == "auto":
                self.dtype = "float16" if config.torch_dtype == "float16" else "bfloat16"
            self.ops = cupy_ops.create(self.dtype, self.kv)
        return self.ops


def cpu_activations(config: ModelConfig) -> str:
    """What the CPU's packed-weight GEMV rounds activations to for this model: int8, as
    llama.cpp's quantized paths do and at twice int16's products an instruction, from hidden
    size 2048 (Llama-3.2-1B, Qwen3-1.7B and up); int16 below, where a step is cheap anyway and
    rounding costs most (the default SmolLM2-135M: top-1 agreement with float32 over 2,000
    tokens 97.0-97.1% with int8, 99.95-100% with int16; tests/test_q8.py)."""
    return "int8" if config.hidden_size >= 2048 else "int16"


def cuda_available() -> bool:
    try:
        from model.ops import cupy_ops
    except ImportError:
        return False
    return cupy_ops.available()


def resolve(backend: str = "auto", dtype: str = "auto", kv: str = "f16") -> Backend:
    """kv: the K/V cache's type (--cache-type-k, --kv-cache-dtype); q8_0 only on the CPU beside packed
    weights, fp8 only on CUDA."""
    if backend == "auto":
        backend = "cuda" if cuda_available() else "cpu"
    check_kv_cache(backend, dtype, kv)
    if backend == "numpy":
        if dtype not in ("auto", "float32"):
            raise ValueError(f"the numpy backend computes in float32; --dtype {dtype} needs --backend cpu or cuda")
        return Backend(backend, "float32", NumpyOps())
    if backend == "cpu":
        if dtype not in ("auto", "float32", *CPU_DTYPES):
            raise ValueError(f"the CPU backend keeps weights in float32, q8_0 or q4_k; --dtype {dtype} needs"
                             " --backend cuda")
        # its kernels compile in prepare, once the model is checked
        return Backend("cpu", "q8_0" if dtype == "auto" else dtype, kv=kv)
    try:
        from model.ops import cupy_ops
    except ImportError:
        raise ValueError("--backend cuda needs CuPy: pip install -e '.[cuda12]' (or '.[cuda13]'),"
                         " or use --backend cpu") from None
    if not cupy_ops.available():
        raise ValueError("--backend cuda: CuPy sees no CUDA device (or no driver); use --backend cpu")
    if dtype in CPU_DTYPES:
        raise ValueError(f"--dtype {dtype} is for --backend cpu; the CUDA kernels take bfloat16, float16 or float32")
    return Backend("cuda", dtype, kv=kv)


def check_kv_cache(backend: str, dtype: str, kv: str) -> None:
    """Refuse a K/V cache type that --backend and --dtype cannot keep (auto passes until resolved)."""
    if kv not in KV_CACHE_TYPES:
        raise ValueError(f"K/V cache type {kv!r} is not built; the cache types are {' and '.join(KV_CACHE_TYPES)}")
    if kv == "q8_0" and (backend in ("numpy", "cuda") or dtype not in ("auto", *CPU_DTYPES)):
        raise ValueError(f"a q8_0 K/V cache is the CPU backend's, beside q8_0 or q4_k weights, not --backend"
                         f" {backend} --dtype {dtype}; use --backend cpu, or f16 K/V")
    if kv == "fp8" and backend in ("cpu", "numpy"):
        raise ValueError(f"an fp8 K/V cache (--kv-cache-dtype fp8) is --backend cuda's, not {backend}'s; on the CPU,"
                         " --cache-type-k q8_0 --cache-type-v q8_0 quantizes K/V")


def cpu_kernels() -> type:
    """NumbaOps, whose modules' import compiles the kernels or reads them from numba's cache."""
    started = time.monotonic()
    from model.ops.numba_ops import NumbaOps

    took = time.monotonic() - started
    if took > 2:
        log.info(f"compiled the CPU kernels in {took:.0f} s (once per machine: later starts read numba's cache)")
    return NumbaOps


def check_model(backend: Backend, config: ModelConfig) -> None:
    """Refuse, before loading weights, a model the backend's kernels cannot run."""
    dims = sorted({config.head_dim_of(i) for i in range(config.num_layers)})  # Gemma 4's full layers' own
    named = " and ".join(map(str, dims))
    if backend.name == "cpu" and any(d % 8 for d in dims):
        raise ValueError(f"the CPU kernels read K/V rows eight values at a time; this model's head_dim is"
                         f" {named}; use --backend numpy")
    if backend.name != "cuda":
        return
    if dims[-1] > CUDA_MAX_HEAD_DIM or any(d % 8 for d in dims):  # decode attention: 16 bytes a load
        raise ValueError(f"the CUDA kernels take a head_dim that is a multiple of 8, at most {CUDA_MAX_HEAD_DIM};"
                         f" this model's is {named}; use --backend cpu")
