"""Gemma 4 beyond its logits (tests/test_families.py holds those against transformers on every
backend): both spellings of its config.json, a K/V cache whose layers differ in shape and whose
last layers keep none, and requests that share steps, are cut into chunks, or are preempted
(their blocks spilled to the host or recomputed), each getting what it gets alone."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.backend import Backend, check_model
from model.config import ModelConfig
from model.families.gemma4 import TEXT_DEFAULTS
from model.kv_cache import KVCache
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_models import FAMILIES, make_family, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory, tiny_dir):
    """The tiny Gemma 4 of tools/family_models.py (per-layer embeddings, two layers reading
    earlier layers' K/V), with the tiny model's tokenizer."""
    path, _ = make_family("gemma4", tmp_path_factory.mktemp("gemma4"))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / file, path / file)
    return path


def test_the_released_and_the_new_spellings_read_alike():
    """The released config.json (Gemma4ForConditionalGeneration, a text_config with
    global_head_dim and num_global_key_value_heads) and transformers 5.23's own (per_layer_config)
    give one config: the full layer's head size and its single K/V head."""
    text = FAMILIES["gemma4-moe"][0]
    new = {k: v for k, v in text.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    new["per_layer_config"] = {"2": {"head_dim": 32, "num_key_value_heads": 1}}
    wrapped = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
               "text_config": {k: v for k, v in text.items() if TEXT_DEFAULTS.get(k, ...) != v},
               "vision_config": {"model_type": "gemma4_vision"}}
    released, current, outer = (ModelConfig.from_dict(raw) for raw in (text, new, wrapped))
    assert released.layer_heads == ((2, 16), (2, 16), (1, 32)) and released.experts_beside_mlp
    assert released.num_experts == 4 and released.experts_per_token == 2 and released.norm_topk_prob
    assert current == released
    assert outer.model_type == "gemma4_text" and outer.layer_heads == released.layer_heads
    assert ModelConfig.from_dict({**text, "enable_moe_block": False}).num_experts == 0


def test_the_cache_keeps_each_layers_shape_and_none_where_a_layer_reads_anothers(gemma4_dir):
    """Sliding layers' heads of 16, the full layer's of 32, nothing for the two that read layers 1
    and 2; the size the server budgets per block is what the arrays hold, and blocks copied out
    and back (a spill) come back whole in every layer."""
    config = ModelConfig.load(gemma4_dir)
    assert config.kv_sources == (0, 1, 2, 1, 2) and config.attention_layers == [0, 1, 2]
    for ops in (NumpyOps(), CudaOps(np, CpuLauncher(), "bfloat16")):
        cache = KVCache(ops, config, num_blocks=8, block_size=4)
        assert [None if k is None else k.shape for k in cache.k] == \
            [(2, 8, 4, 16), (2, 8, 4, 16), (2, 8, 4, 32), None, None]
        held = sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in cache.kv_layers)
        assert KVCache.bytes_per_block(config, 4, ops.storage_dtype.itemsize) == held
        rng = np.random.default_rng(4)
        for k in cache.k[:3] + cache.v[:3]:
            k[...] = rng.integers(0, 1 << 14, k.shape).astype(k.dtype)
        saved = cache.save_blocks([1, 6])
        assert saved.shape == (2, held // ops.storage_dtype.itemsize)
        cache.load_blocks([3, 0], saved)
        for k in cache.k[:3] + cache.v[:3]:
            assert np.array_equal(k[:, [3, 0]], k[:, [1, 6]])


def test_its_gguf_reads_as_its_checkpoint(tmp_path):
    """llama.cpp's metadata (key_length the full layers', key_length_swa the sliding ones', a
    window flag a layer, the widths one a layer, shared_kv_layers, the rope_freqs tensor) gives
    the checkpoint's config, and its 26B-A4B's experts beside the MLP."""
    from family_gguf import write_family_gguf
    from model.gguf.convert import convert_gguf

    want = ModelConfig.from_dict(FAMILIES["gemma4"][0])
    got = ModelConfig.load(convert_gguf(write_family_gguf("gemma4", tmp_path / "g.gguf"), tmp_path / "served"))
    for field in ("layer_heads", "kv_sources", "layer_widths", "layer_windows", "rope_scaling", "partial_rotary_factor",
                  "rope_theta", "local_rope_theta", "query_scale", "value_norm", "per_layer_input", "final_softcap",
                  "head_dim", "num_kv_heads", "intermediate_size"):
        assert getattr(got, field) == getattr(want, field), field
    want = ModelConfig.from_dict(FAMILIES["gemma4-moe"][0])
    got = ModelConfig.load(convert_gguf(write_family_gguf("gemma4-moe", tmp_path / "m.gguf"), tmp_path / "moe"))
    for field in ("layer_heads", "num_experts", "experts_per_token", "expert_intermediate_size", "norm_topk_prob",
                  "experts_beside_mlp", "moe_layers", "per_layer_input"):
        assert getattr(got, field) == getattr(want, field), field


def test_head_sizes_the_cuda_kernels_do_not_take_are_refused_by_name():
    """Gemma 4's full layers' 512 is taken (as the sliding ones' 256); a larger one is named."""
    check_model(Backend("cuda", "bfloat16", None), ModelConfig.from_dict(
        {**FAMILIES["gemma4"][0], "head_dim": 256, "global_head_dim": 512}))
    config = ModelConfig.from_dict({**FAMILIES["gemma4"][0], "global_head_dim": 1024})
    with pytest.raises(ValueError, match="this model.s is 16 and 1024"):
        check_model(Backend("cuda", "bfloat16", None), config)


def test_its_full_layers_heads_of_512_on_the_cuda_kernels(tmp_path):
    """E2B's head sizes (256 sliding, 512 full) through the CUDA kernels (the CPU harness):
    prefill in chunks, then decode, each step's logits as NumPy's."""
    path, _ = write_checkpoint({**FAMILIES["gemma4"][0], "head_dim": 256, "global_head_dim": 512}, tmp_path)
    ids = PROMPTS[2]
    got = []
    for ops in (NumpyOps(), CudaOps(np, CpuLauncher())):
        runner = ModelRunner.from_dir(path, num_blocks=16, block_size=4, ops=ops)
        steps = [runner.logits(StepPlan([Row("a", ids[:17], 0, list(range(16)), sample=True)])),
                 runner.logits(StepPlan([Row("a", ids[17:], 17, list(range(16)), sample=True)])),
                 runner.logits(StepPlan([Row("a", [5], len(ids), list(range(16)), sample=True)]))]
        got.append(np.stack([ops.to_host(s)[0] for s in steps]))
    assert np.abs(got[1] - got[0]).max() < 1e-4 * np.abs(got[0]).max()


def generate(path, prompts, num_blocks=64, seeds=None, **config):
    """Each prompt's 10 tokens, greedy or seeded by seeds (one a prompt)."""
    runner = ModelRunner.from_dir(path, num_blocks=num_blocks, block_size=4, ops=NumbaOps("q8_0"))
    h = Harness(runner, Tokenizer(path), **config)
    rids = [h.submit(p, max_tokens=10, ignore_eos=True, sampling=SamplingParams(temperature=0.0) if seeds is None
                     else SamplingParams(temperature=1.0, seed=seeds[i])) for i, p in enumerate(prompts)]
    h.run()
    assert h.pool.used == 0
    return [h.tokens(r) for r in rids], h


SEEDS = [11, 12, 13]
PROMPTS = [[int(t) for t in np.random.default_rng(seed).integers(3, 256, n)] for n, seed in ((21, 1), (6, 2), (30, 3))]


@pytest.fixture(scope="module")
def alone(gemma4_dir):
    """Each prompt run alone, greedy and then seeded."""
    return [[generate(gemma4_dir, [p], seeds=None if seeds is None else [seeds[i]], prefill_chunk=64)[0][0]
             for i, p in enumerate(PROMPTS)] for seeds in (None, SEEDS)]


@pytest.mark.parametrize("config", [dict(prefill_chunk=7), dict(prefill_chunk=64, max_seqs=2),
                                    dict(num_blocks=11, prefill_chunk=64, immunity_tokens=2, swap_blocks=0),
                                    dict(num_blocks=11, prefill_chunk=64, immunity_tokens=2, swap_blocks=64)],
                         ids=["small-chunks", "two-at-once", "recompute", "spill"])
def test_batching_chunking_and_preemption_change_nothing(gemma4_dir, alone, config):
    """Greedy and seeded requests together get what each gets alone; in a pool too small for
    all at once, a victim recomputes its K/V or gets its blocks back from the host."""
    for seeds, want in zip((None, SEEDS), alone):
        tokens, h = generate(gemma4_dir, PROMPTS, seeds=seeds, **config)
        assert tokens == want
        if "swap_blocks" in config:
            assert h.stats.preemptions > 0
