"""One thread runs a model's kernels, whichever thread asks: loading, steps, copies.

numba's OpenMP layer (libgomp) keeps a team of worker threads for each thread that starts a
parallel region. Once the teams together hold more threads than the process has CPUs, libgomp
stops spinning between regions, so each region's start waits for a futex wake. A step of the
default model runs a few hundred small regions: when its weights were loaded on one thread and
its steps ran on trio's worker threads, batch 1 went from 4.5 to 10 ms a step (2-core EPYC),
and a chain of small kernels from 14 to 35 us each. CuPy's current device and stream are a
thread's own too. So the entry points hop here (on_compute_thread) and run in place when
already here, and every caller, the server's event loop and a test alike, runs the same step.
"""

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

_ident: int | None = None  # the compute thread's, once it has started


def _note_ident() -> None:
    global _ident
    _ident = threading.get_ident()


def _executor_for_this_process() -> ThreadPoolExecutor:
    """The compute thread's queue: the thread itself starts with the first job, and notes who it
    is before running any."""
    return ThreadPoolExecutor(1, thread_name_prefix="spool-compute", initializer=_note_ident)


_executor = _executor_for_this_process()


def _forget() -> None:
    """A forked child has no compute thread (fork copies only the caller): it starts its own."""
    global _executor, _ident
    _executor, _ident = _executor_for_this_process(), None


os.register_at_fork(after_in_child=_forget)


def here() -> bool:
    """Whether the caller is the compute thread."""
    return threading.get_ident() == _ident


def submit(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) queued on the compute thread."""
    return _executor.submit(fn, *args, **kwargs)


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the compute thread, waited for; its exception is raised here."""
    if here():
        return fn(*args, **kwargs)
    return submit(fn, *args, **kwargs).result()


def on_compute_thread(fn):
    """fn, always run on the compute thread."""
    @functools.wraps(fn)
    def hop(*args, **kwargs):
        return call(fn, *args, **kwargs)
    return hop
