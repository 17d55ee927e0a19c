"""The numbers: config, weights, tokenizer, the forward pass, the KV cache and the runner."""

import logging
import os

from model.caches import numba_cache_dir
from model.errors import one_line
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

# numba's cache, before numba loads: keyed by this package's source, so no kernel outlives an
# edit to a module it inlines (model/caches.py). Where the cache root cannot be written, numba
# keeps its own places (beside each module, or its user-wide cache), which key on one file.
if not os.environ.get("NUMBA_CACHE_DIR"):
    try:
        os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
    except OSError as exc:
        logging.getLogger("spool.model").warning(
            "numba's cache stays in numba's own places, blind to edits of helper modules: %s; "
            "set SPOOL_CACHE_DIR to a writable directory", one_line(exc))
