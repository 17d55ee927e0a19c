"""The numbers: config, weights, tokenizer, the forward pass, the KV cache and the runner."""

import os

from model.threads import usable_cpus

# Thread pools, before NumPy loads: a step alternates OpenBLAS GEMMs with numba kernels
# (model/ops/numba_ops.py), and on a small machine each pool's idle threads spinning after its
# call slow the other's next one (a batch-64 step 1.5x, measured). OpenBLAS's sleep at once;
# numba's OpenMP threads spin briefly, which keeps their own back-to-back kernels fast. Both
# pools are as large as the CPUs this process may use (model/threads.py), not the machine.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
_CPUS = str(usable_cpus())
os.environ.setdefault("OPENBLAS_NUM_THREADS", _CPUS)
os.environ.setdefault("NUMBA_NUM_THREADS", _CPUS)
