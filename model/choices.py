"""The values --backend and --dtype take, importable before NumPy loads: the command line is
read first, as --threads sizes the thread pools that NumPy and numba start with."""

BACKENDS = ("auto", "cpu", "numpy", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32", "q8_0", "q4_k")
