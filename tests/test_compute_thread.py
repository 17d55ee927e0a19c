"""Every kernel of a model runs on the compute thread (model/compute.py), whichever thread loads
it or asks for a step: libgomp keeps one team of workers, which spin between kernels rather than
sleep (two teams on two CPUs made batch 1 twice as slow)."""

import inspect
import os
import select
import signal
import threading

import pytest
import trio

from app.engine import Engine, EngineConfig, GenerationParams
from model import compute
from model.ops.numba_ops import NumbaOps
from model.runner import ModelRunner, load_model
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer


def spied(ops, seen: set):
    """ops, with the thread of every call of its methods added to seen (but release's: the
    sampler forgetting an ended request is bookkeeping, done where the engine retires it)."""
    for name, method in inspect.getmembers(ops, inspect.ismethod):
        if not name.startswith("_") and name != "release":
            def wrapper(*args, _method=method, **kwargs):
                seen.add(threading.get_ident())
                return _method(*args, **kwargs)
            setattr(ops, name, wrapper)
    return ops


def in_thread(fn):
    """fn() on a new plain thread, as a worker pool's would call it."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def test_calls_run_on_one_thread_nested_calls_in_place_and_errors_come_back():
    ident = compute.call(threading.get_ident)
    assert ident != threading.get_ident()
    assert in_thread(lambda: compute.call(threading.get_ident)) == ident
    assert compute.call(compute.call, threading.get_ident) == ident  # from the thread itself: no deadlock
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    assert compute.call(threading.get_ident) == ident  # the thread outlives an error


async def test_loading_and_steps_from_any_thread_run_the_kernels_on_the_compute_thread(tiny_dir):
    seen: set = set()
    model = load_model(tiny_dir, spied(NumbaOps("q8_0"), seen))  # from the test's own thread
    assert seen == {compute.call(threading.get_ident)}
    runner = ModelRunner(model.config, model, num_blocks=64, block_size=4)
    engine = Engine(runner, Tokenizer(tiny_dir), EngineConfig(max_model_len=256))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        _, frames = engine.submit([3, 14, 15, 92, 65], GenerationParams(SamplingParams(temperature=0.0), max_tokens=5))
        async for frame in frames:
            if frame.finish_reason is not None:
                break
        nursery.cancel_scope.cancel()
    assert frame.finish_reason == "length"
    assert seen == {compute.call(threading.get_ident)}


def test_a_forked_child_starts_its_own_compute_thread():
    compute.call(threading.get_ident)  # the parent's is running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a call must not wait on the parent's thread, which it lacks
        os.write(write, b"ok" if compute.call(lambda: 6 * 7) == 42 else b"no")
        os._exit(0)
    os.close(write)
    answered = select.select([read], [], [], 30)[0]
    if not answered:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answered and os.read(read, 2) == b"ok"
