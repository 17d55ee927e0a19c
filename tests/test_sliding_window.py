"""Sliding-window attention in the paged KV cache (issue 28): where every layer slides
(Mistral's, Phi-3's), a request's blocks wholly before its next query's window go back to the
pool as it runs, so a request four windows long holds at most window / block + 1 blocks while it
decodes, and writes the same tokens as when nothing is freed. Where some layer reads the whole
context (Gemma's global layers), nothing is freed."""

import json

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.ops.cuda_ops import CudaOps
from model.ops.numpy_ops import NumpyOps
from model.config import ModelConfig
from model.runner import ModelRunner
from model.tokenizer import Tokenizer
from tiny_model import make_tiny_model

WINDOW, BLOCK = 8, 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """The tiny llama as a Mistral: every layer sees the last WINDOW positions."""
    path = make_tiny_model(tmp_path_factory.mktemp("mistral"))
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config))
    return path


BACKENDS = {"numpy": NumpyOps, "cuda-harness": lambda: CudaOps(np, CpuLauncher())}  # the latter overlaps steps


def harness(path, free: bool, backend: str = "numpy", **config) -> Harness:
    runner = ModelRunner.from_dir(path, num_blocks=64, block_size=BLOCK, ops=BACKENDS[backend]())
    h = Harness(runner, Tokenizer(path), prefill_chunk=8, **config)
    if not free:
        h.planner.tables.window = 0
    return h


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_request_four_windows_long_holds_a_window_of_blocks(mistral, backend):
    """Checked after every tick of its decode (on the CUDA kernels, in the overlapped loop, where
    a step is planned before the one in flight lands)."""
    prompt = list(range(5, 5 + 4 * WINDOW))
    h = harness(mistral, free=True, backend=backend)
    assert h.runner.overlaps == (backend == "cuda-harness")
    assert ModelConfig.load(mistral).kv_window == WINDOW and h.planner.tables.window == WINDOW
    rid = h.submit(prompt, max_tokens=3 * WINDOW, ignore_eos=True)
    request = h.planner.queues.requests[rid]
    decoding_ticks = 0
    while h.planner.has_work or h.in_flight is not None:
        h.tick()
        if rid in h.planner.queues.requests and request.output_ids:
            decoding_ticks += 1
            s = request.schedule
            assert len(s.block_table) <= WINDOW // BLOCK + 1, (s.num_computed, s.block_table)
            assert s.dropped_blocks + len(s.block_table) >= -(-request.num_tokens // BLOCK) - 1
    assert decoding_ticks >= 3 * WINDOW - 1 and h.pool.used == 0
    freed = h.tokens(rid)

    kept = harness(mistral, free=False, backend=backend)
    rid = kept.submit(prompt, max_tokens=3 * WINDOW, ignore_eos=True)
    kept.run()
    assert kept.tokens(rid) == freed and len(freed) == 3 * WINDOW


def test_requests_sharing_a_prefix_and_preempted_keep_their_tokens(mistral):
    """Four requests on a cache too small for all of them at once (preempted and recomputed),
    two sharing a cached prefix: the same tokens as with nothing freed, no block lost."""
    prompts = [list(range(5, 37)), list(range(5, 37)) + [40, 41], list(range(50, 80)), list(range(90, 110))]

    def run(free: bool) -> list[list[int]]:
        runner = ModelRunner.from_dir(mistral, num_blocks=24, block_size=BLOCK)
        h = Harness(runner, Tokenizer(mistral), prefill_chunk=8, max_seqs=4, max_batched_tokens=16)
        if not free:
            h.planner.tables.window = 0
        rids = [h.submit(p, max_tokens=20, ignore_eos=True) for p in prompts]
        h.run()
        assert h.pool.used == 0
        return [h.tokens(r) for r in rids], h.stats.preemptions

    freed, preempted = run(True)
    kept, preempted_keeping = run(False)
    assert freed == kept and all(len(t) == 20 for t in freed)
    assert preempted < preempted_keeping  # freed blocks spared a preemption


def test_a_model_with_global_layers_frees_nothing(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=WINDOW,
                  use_sliding_window=True, max_window_layers=1, attention_bias=False)
    (path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.load(path).layer_windows == (0, WINDOW)
    h = harness(path, free=True)
    assert h.planner.tables.window == 0
    rid = h.submit(list(range(5, 5 + 4 * WINDOW)), max_tokens=4, ignore_eos=True)
    h.tick()
    h.tick()
    assert h.planner.queues.requests[rid].schedule.dropped_blocks == 0
