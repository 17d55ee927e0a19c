"""Every family against transformers: tiny random checkpoints of each family's real config
(tools/family_models.py), on every backend, held against the logits and greedy tokens that
transformers computed from the same files (tests/data/families/*.npz).

The fixtures were made with tools/family_fixtures.py (torch 2.13.0, transformers 5.23.0, as each
fixture's `versions` says); to regenerate after changing FAMILIES, in an environment with both:

    python tools/family_fixtures.py
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_harness import CpuLauncher
from model.config import ModelConfig
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_models import FAMILIES, make_family  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "data" / "families"
BACKENDS = {"numpy": NumpyOps, "numba": NumbaOps, "cuda-harness": lambda: CudaOps(np, CpuLauncher())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            fixture = dict(np.load(FIXTURES / f"{name}.npz"))
            path, digest = make_family(name, tmp_path_factory.mktemp(name))
            config, context = FAMILIES[name]
            assert str(fixture["digest"]) == digest and str(fixture["config"]) == json.dumps(config, sort_keys=True), (
                f"tests/data/families/{name}.npz was made from other weights or another config:"
                " run tools/family_fixtures.py again")
            made[name] = path, fixture, context
        return made[name]

    return get


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_transformers(checkpoints, name, backend):
    """Prefill in two chunks, then one token a step: every position's logits within 1e-4 of
    transformers' (float32 both), and the greedy continuation token for token."""
    path, fixture, context = checkpoints(name)
    runner = ModelRunner.from_dir(path, num_blocks=16, block_size=4, ops=BACKENDS[backend](),
                                  max_model_len=context)
    ids, want = [int(i) for i in fixture["ids"]], fixture["logits"]
    table = list(range(15, -1, -1))  # blocks out of order
    half = len(ids) // 2

    def step(tokens, start):
        return runner.ops.to_host(runner.logits(StepPlan([Row("a", tokens, start, table, sample=True)])))[0]

    assert rel_err(step(ids[:half], 0), want[half - 1]) < 1e-4
    for pos in range(half, len(ids)):
        assert rel_err(step([ids[pos]], pos), want[pos]) < 1e-4, pos
    tokens = list(ids)
    for _ in range(len(fixture["greedy"])):
        logits = step([tokens[-1]], len(tokens) - 1) if len(tokens) > len(ids) else want[-1]
        tokens.append(int(np.argmax(logits)))
    assert tokens[len(ids):] == fixture["greedy"].tolist()


def test_family_switches_are_read():
    """What each config spelling turns on, so that a fixture cannot pass by accident."""
    c = {name: ModelConfig.from_dict(FAMILIES[name][0]) for name in FAMILIES}
    assert c["qwen3-yarn"].rope_scaling["rope_type"] == "yarn" and c["qwen3-yarn"].rope_theta == 10000.0
    assert c["phi3-longrope-long"].rope_scaling["original_max_position_embeddings"] == 32
    assert c["phi3-longrope-long"].rope_scaling["factor"] == 256 / 32
    assert c["phi4-mini"].partial_rotary_factor == 0.75 and c["phi4-mini"].fused_tensors
    assert c["smollm3"].rope_layers == (True, False, True, False)
    assert c["llama3-rope"].rope_layers is None and c["llama3-rope"].partial_rotary_factor == 1.0
    assert c["gemma2"].layer_windows == (8, 0) and c["gemma2"].attn_softcap == 2.0 and c["gemma2"].gelu
    assert c["gemma3"].layer_windows == (6, 6, 0) and c["gemma3"].local_rope_theta == 100.0
    assert c["gemma3"].query_scale == 16 ** -0.5 and c["gemma3"].qk_norm and c["gemma3"].final_softcap == 0.0
