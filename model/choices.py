"""The values --backend, --dtype and --cache-type-k/-v take, importable before NumPy loads: the
command line is read first, as --threads sizes the thread pools that NumPy and numba start with."""

BACKENDS = ("auto", "cpu", "numpy", "cuda")
CPU_DTYPES = ("q8_0", "q4_k")  # packed weights: the CPU backend's alone
DTYPES = ("auto", "bfloat16", "float16", "float32", "q8_0", "q4_k")
# f16: the --dtype's float (float32 beside float32 weights or without F16C); q8_0: the CPU's, 8 bits and a scale;
# fp8: CUDA's (vLLM's --kv-cache-dtype fp8), e4m3 and a scale
KV_CACHE_TYPES = ("f16", "q8_0", "fp8")
