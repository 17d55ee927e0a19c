"""The GPU's spill pool (model/swap.py) on the CPU harness, whose copies are synchronous stand-ins
for the side stream's: blocks go out to slots and come back bit for bit under other ids, slots
are reused once free, and the engine spilling through it gives the tokens of a run that
recomputes instead."""

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.ops.cuda_ops import CudaOps
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.swap import SwapPool
from model.tokenizer import Tokenizer
from test_cuda_forward import cuda_ops

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def test_spilled_blocks_come_back_bit_for_bit_under_other_ids(tiny_dir):
    ops = CudaOps(np, CpuLauncher(), "bfloat16")
    config = ModelConfig.load(tiny_dir)
    cache = KVCache(ops, config, num_blocks=8, block_size=4)
    rng = np.random.default_rng(4)
    for k in cache.k + cache.v:
        k[...] = rng.integers(0, 1 << 16, k.shape, dtype=np.uint16)
    pool = SwapPool(cache, num_slots=3)
    assert pool.host.dtype == np.uint16 and pool.host.nbytes == 3 * KVCache.bytes_per_block(config, 4, itemsize=2)
    before = [k.copy() for k in cache.k + cache.v]
    spill = pool.save([1, 6])
    assert len(pool.free) == 1
    for k in cache.k + cache.v:  # the blocks are reused by others meanwhile
        k[:, [1, 6]] = 0
    pool.load([3, 0], spill)
    for k, old in zip(cache.k + cache.v, before):
        assert np.array_equal(k[:, [3, 0]], old[:, [1, 6]])
    pool.release(spill)
    again = pool.save([2, 5, 7])  # every slot, the released ones included
    assert sorted(again.slots) == [0, 1, 2] and not pool.free


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_spilling_to_the_pool_generates_what_recompute_does(tiny_dir, backend, caplog):
    tok = Tokenizer(tiny_dir)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 390, n).tolist() for n in (9, 23, 5, 14)]
    results = []
    for swap_blocks in (0, 12):
        runner = ModelRunner.from_dir(tiny_dir, num_blocks=16, block_size=4, ops=cuda_ops(backend))
        if swap_blocks:
            runner.reserve_swap(swap_blocks)
            save, spills = runner.swap.save, []
            runner.swap.save = lambda ids: spills.append(len(ids)) or save(ids)
        h = Harness(runner, tok, immunity_tokens=2, swap_blocks=swap_blocks)
        rids = [h.submit(p, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.3), max_tokens=14)
                for p in prompts]
        h.run()
        results.append(([h.tokens(r) for r in rids], h, runner))
    (recomputed, h0, _), (spilled, h, runner) = results
    assert h0.stats.preemptions > 0 and h.stats.preemptions > 0
    assert spilled == recomputed
    assert spills and h.planner.preemption.swap_used == 0
    # spilled, and every slot free again but those the prefix cache's host tier holds, each
    # host-tier copy having found its slot (the moves run in the order their room was counted)
    assert len(runner.swap.free) + len(h.pool.host.entries) == 12
    assert "could not be" not in caplog.text
