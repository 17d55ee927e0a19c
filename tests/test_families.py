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

import gguf
import numpy as np
import pytest

from cuda_harness import CpuLauncher
from model.config import ModelConfig
from model.families.gemma3 import TEXT_DEFAULTS
from model.gguf.convert import convert_gguf
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.quant.strips import Strips
from model.runner import ModelRunner, Row, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_fixtures import EMBED_LENGTHS  # noqa: E402
from family_gguf import write_family_gguf  # noqa: E402
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
    assert_matches(runner, fixture)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", ["gemma3", "phi4-mini", "qwen3-yarn", "smollm3"])
def test_family_embeddings_match_transformers(checkpoints, name, backend):
    """Embedding rows of three lengths in one step, one beside a sampling row: each the unit
    vector of transformers' last hidden state (its base model's, after the final norm)."""
    path, fixture, context = checkpoints(name)
    runner = ModelRunner.from_dir(path, num_blocks=64, block_size=4, ops=BACKENDS[backend](), max_model_len=context)
    ids = [int(i) for i in fixture["ids"]]
    rows = [Row(i, ids[:n], 0, list(range(8 * i, 8 * i + 8)), embed=True) for i, n in enumerate(EMBED_LENGTHS)]
    rows.insert(1, Row("s", ids, 0, list(range(40, 48)), sample=True))
    got = {s.request_id: s for s in runner.step(StepPlan(rows))}
    assert set(got) == {0, 1, 2, "s"} and got["s"].token_id == int(np.argmax(fixture["logits"][-1]))
    for i, want in enumerate(fixture["pooled"]):
        assert got[i].embedding.dtype == np.float32 and abs(np.linalg.norm(got[i].embedding) - 1) < 1e-5
        assert np.abs(got[i].embedding - want).max() < 1e-4, i


def test_a_base_models_checkpoint_loads_as_the_causal_lm(checkpoints, tmp_path):
    """Qwen3-Embedding saves its Qwen3Model: tensor names without "model.", no lm_head."""
    from safetensors.numpy import load_file, save_file

    path, fixture, context = checkpoints("qwen2")  # tied: no lm_head to drop
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    save_file({k.removeprefix("model."): v for k, v in load_file(path / "model.safetensors").items()},
              str(bare / "model.safetensors"))
    runner = ModelRunner.from_dir(bare, num_blocks=16, block_size=4, max_model_len=context)
    ids = [int(i) for i in fixture["ids"]][:EMBED_LENGTHS[0]]
    [got] = runner.step(StepPlan([Row("e", ids, 0, list(range(4)), embed=True)]))
    assert np.abs(got.embedding - fixture["pooled"][0]).max() < 1e-4


def test_a_gemma3_vision_language_checkpoint_serves_its_language_model(checkpoints, tmp_path):
    """Gemma 3 4B-27B: Gemma3ForConditionalGeneration's config.json (text_config holding only
    what differs from Gemma3TextConfig's defaults) and its language model's tensors under
    language_model.model. (transformers 4) or model.language_model. (5), a vision tower beside
    them: the text model's logits, the tower unread."""
    from safetensors.numpy import load_file, save_file

    path, fixture, context = checkpoints("gemma3")
    text = json.loads((path / "config.json").read_text())
    defaults = {k: v for k, v in TEXT_DEFAULTS.items() if k in text and text[k] == v}
    outer = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
             "eos_token_id": text["eos_token_id"], "torch_dtype": "float32",
             "text_config": {k: v for k, v in text.items() if k not in defaults and k not in ("architectures",)},
             "vision_config": {"model_type": "siglip_vision_model"}}
    tensors = load_file(path / "model.safetensors")
    for prefix in ("language_model.model.", "model.language_model."):
        vl = tmp_path / prefix.replace(".", "-")
        vl.mkdir()
        (vl / "config.json").write_text(json.dumps(outer))
        save_file({**{prefix + k.removeprefix("model."): v for k, v in tensors.items()},
                   "vision_tower.vision_model.post_layernorm.weight": np.ones(8, np.float32)},
                  str(vl / "model.safetensors"))
        assert ModelConfig.load(vl).model_type == "gemma3_text"
        runner = ModelRunner.from_dir(vl, num_blocks=16, block_size=4, max_model_len=context)
        ids = [int(i) for i in fixture["ids"]]
        logits = runner.logits(StepPlan([Row("a", ids, 0, list(range(16)), sample=True)]))[0]
        assert rel_err(logits, fixture["logits"][-1]) < 1e-4


@pytest.mark.parametrize("text_type", ["ministral3", "mistral"])
def test_a_mistral3_vision_language_checkpoint_serves_its_language_model(checkpoints, tmp_path, text_type):
    """Ministral 3's and Mistral Small 3.x's Mistral3ForConditionalGeneration: the language
    model under model.language_model., its lm_head outside, a vision tower unread; a text_config
    of Ministral 3 (YaRN, the temperature) gives the fixture's logits, and one that says plain
    Mistral is served the same way (without a temperature: different logits past 16 tokens)."""
    from safetensors.numpy import load_file, save_file

    path, fixture, context = checkpoints("ministral3")
    text = {**json.loads((path / "config.json").read_text()), "model_type": text_type}
    if text_type == "mistral":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    outer = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
             "text_config": {k: v for k, v in text.items() if k != "architectures"},
             "vision_config": {"model_type": "pixtral"}}
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps(outer))
    tensors = load_file(path / "model.safetensors")
    save_file({**{("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
                  for k, v in tensors.items()},
               "model.vision_tower.ln_pre.weight": np.ones(8, np.float32)}, str(vl / "model.safetensors"))
    c = ModelConfig.load(vl)
    assert c.model_type == "ministral3" and (c.attention_temperature is not None) == (text_type == "ministral3")
    runner = ModelRunner.from_dir(vl, num_blocks=16, block_size=4, max_model_len=context)
    ids = [int(i) for i in fixture["ids"]]
    logits = runner.logits(StepPlan([Row("a", ids, 0, list(range(16)), sample=True)]))[0]
    assert (rel_err(logits, fixture["logits"][-1]) < 1e-4) == (text_type == "ministral3")


# Gemma 2's GGUF scales queries by head_dim ** -0.5 as llama.cpp infers it (its fixture uses 24)
GGUF_FAMILIES = ["gemma3", "gemma4", "gemma4-moe", "gpt-oss", "ministral3", "mixtral", "olmoe", "phi3-longrope-long", "phi3-longrope-short", "phi4-mini", "qwen2",
                 "qwen3-moe", "qwen3-yarn", "qwen3.5", "qwen3.5-moe", "smollm3-4"]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_family_gguf_matches_transformers(checkpoints, tmp_path, name, backend):
    """The same checkpoint as llama.cpp's converter would write it (tests/family_gguf.py),
    served in place: the transformers fixture holds for it too."""
    _, fixture, context = checkpoints(name)
    served = convert_gguf(write_family_gguf(name, tmp_path / f"{name}.gguf"), tmp_path / "served")
    runner = ModelRunner.from_dir(served, num_blocks=16, block_size=4, ops=BACKENDS[backend](),
                                  max_model_len=context)
    assert_matches(runner, fixture)


@pytest.mark.parametrize("name", ["gemma3", "gemma4", "gemma4-moe", "mixtral", "phi4-mini"])
def test_family_gguf_of_q8_0_served_packed(checkpoints, tmp_path, name):
    """Q8_0 matrices kept in their blocks (fused q/k/v and gate/up for Phi, every expert's slice
    of Mixtral's 3-D stacks, its router F32 as llama.cpp keeps it): logits within
    Q8_0's rounding of transformers' float32 ones (weights and activations both rounded to 8
    bits: 2-5% of the largest logit at these widths and depths, as for a llama checkpoint
    quantized while loading; twice what rounding the weights alone gives)."""
    _, fixture, context = checkpoints(name)
    path = write_family_gguf(name, tmp_path / f"{name}.gguf", gguf.GGMLQuantizationType.Q8_0)
    runner = ModelRunner.from_dir(convert_gguf(path, tmp_path / "served"), num_blocks=16, block_size=4,
                                  ops=NumbaOps("q8_0"), max_model_len=context)
    for layer in runner.model.w.layers:  # (Gemma 4's per-layer projections are 8 wide: F32 in the file)
        mlp = (layer.w_gate_up,) if layer.experts is None else (layer.experts.gate_up, layer.experts.down)
        assert all(isinstance(w, Strips) for w in (layer.wqkv, *mlp))
    ids = [int(i) for i in fixture["ids"]]
    plan = StepPlan([Row("a", ids, 0, list(range(16)), sample=True)])
    err = rel_err(runner.ops.to_host(runner.logits(plan))[0], fixture["logits"][-1])
    # Gemma 4's MoE: a near tie of two experts (logits 0.0530 and 0.0530, layer 2, token 11) goes
    # the other way on rounded weights, so one token is routed differently
    assert 1e-5 < err < (0.1 if name == "gemma4-moe" else 6e-2), err


def test_a_gpt_oss_gguf_of_mxfp4_experts_is_served_packed(checkpoints, tmp_path):
    """GPT-OSS as released: MXFP4 experts (kept in their blocks, MXFP4Strips, on numba's packed
    path and its grouped kernel) beside F32 attention: logits within MXFP4's rounding of the
    experts (4 bits, one power-of-two scale a block of 32) of transformers' float32 ones, and
    the same as the file's experts dequantized."""
    from model.quant.strips import MXFP4Strips

    _, fixture, context = checkpoints("gpt-oss")
    served = convert_gguf(write_family_gguf("gpt-oss", tmp_path / "o.gguf", gguf.GGMLQuantizationType.MXFP4),
                          tmp_path / "served")
    ids = [int(i) for i in fixture["ids"]]
    plan = StepPlan([Row("a", ids, 0, list(range(16)), sample=True)])
    packed = ModelRunner.from_dir(served, num_blocks=16, block_size=4, ops=NumbaOps("q8_0"), max_model_len=context)
    assert all(isinstance(w, MXFP4Strips) for layer in packed.model.w.layers
               for w in (layer.experts.gate_up, layer.experts.down))
    dequantized = ModelRunner.from_dir(served, num_blocks=16, block_size=4, ops=NumpyOps(), max_model_len=context)
    got, exact = (r.ops.to_host(r.logits(plan))[0] for r in (packed, dequantized))
    assert 1e-5 < rel_err(exact, fixture["logits"][-1]) < 0.3
    assert rel_err(got, exact) < 5e-2


def test_a_qwen35_gguf_with_its_mtp_block_serves_the_layers(checkpoints, tmp_path):
    """llama.cpp's converter writes Qwen3.5's multi-token-prediction block after the layers
    (block_count + 1, nextn_predict_layers 1): it is named as a checkpoint's MTP layer (read only
    for speculation, test_mtp.py), and the layers' logits hold."""
    from model.gguf.names import read_gguf_tensors

    _, fixture, context = checkpoints("qwen3.5")
    path = write_family_gguf("qwen3.5", tmp_path / "mtp.gguf", mtp=True)
    named = {t.hf_name for t in read_gguf_tensors(path) if t.tensor.name.startswith("blk.4.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "model.layers.4.self_attn.o_proj.weight"} <= named
    served = convert_gguf(path, tmp_path / "served")
    assert ModelConfig.load(served).num_layers == 4
    runner = ModelRunner.from_dir(served, num_blocks=16, block_size=4, ops=NumbaOps(), max_model_len=context)
    assert_matches(runner, fixture)


def test_gemma2_gguf_reads_what_llama_cpp_reads(tmp_path):
    """Soft caps and the every-other-layer window from the metadata, the query scale inferred."""
    c = ModelConfig.load(convert_gguf(write_family_gguf("gemma2", tmp_path / "g.gguf"), tmp_path / "served"))
    assert (c.attn_softcap, c.final_softcap, c.layer_windows) == (2.0, 3.0, (8, 0))
    assert c.query_scale == 16 ** -0.5 and c.gelu and c.family.unit_offset_norms


def assert_matches(runner, fixture):
    ids, want = [int(i) for i in fixture["ids"]], fixture["logits"]
    table = list(range(15, -1, -1))  # blocks out of order
    half = len(ids) // 2

    def step(tokens, start):
        row = Row("a", tokens, start, table, sample=True, state_slot=0)  # a hybrid's state slot; others ignore it
        return runner.ops.to_host(runner.logits(StepPlan([row])))[0]

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
    assert c["phi4-mini"].partial_rotary_factor == 0.75 and c["phi4-mini"].family.qkv
    assert c["smollm3"].rope_layers == (True, False, True, False)
    assert c["smollm3-4"].rope_layers == (True, True, True, False)
    assert c["llama3-rope"].rope_layers is None and c["llama3-rope"].partial_rotary_factor == 1.0
    assert c["gemma2"].layer_windows == (8, 0) and c["gemma2"].attn_softcap == 2.0 and c["gemma2"].gelu
    assert c["gemma3"].layer_windows == (6, 6, 0) and c["gemma3"].local_rope_theta == 100.0
    assert c["gemma4"].layer_heads == ((2, 16), (2, 16), (2, 32), (2, 16), (2, 32)) and c["gemma4"].value_norm
    assert c["gemma4"].kv_sources == (0, 1, 2, 1, 2) and c["gemma4"].layer_widths == (128,) * 3 + (256,) * 2
    assert c["gemma4"].per_layer_input == 8 and c["gemma4"].query_scale == 1.0 and c["gemma4"].final_softcap == 3.0
    assert c["gemma4"].rope_scaling == {"rope_type": "proportional"} and c["gemma4"].partial_rotary_factor == 0.25
    assert c["gemma3"].query_scale == 16 ** -0.5 and c["gemma3"].qk_norm and c["gemma3"].final_softcap == 0.0
    oss = c["gpt-oss"]
    assert oss.layer_windows == (6, 0) and oss.swiglu_clamp == (1.702, 1.5) and oss.attention_bias
    assert oss.rope_scaling["rope_type"] == "yarn" and oss.rope_scaling["truncate"] is False
    assert oss.family.attention_sinks and oss.num_experts == 4 and oss.expert_intermediate_size == 32


def test_a_gpt_oss_gguf_reads_what_the_model_was_trained_with(tmp_path):
    """The window on even layers (llama.cpp's pattern of 2), YaRN unrounded, the file's clamp,
    and every layer's sinks and biases mapped."""
    from model.gguf.metadata import read_gguf

    m = read_gguf(write_family_gguf("gpt-oss", tmp_path / "o.gguf"))
    assert m.config.layer_windows == (6, 0) and m.config.swiglu_clamp == (1.702, 1.5)
    assert m.config.rope_scaling["truncate"] is False and m.config.norm_topk_prob
    names = {t.hf_name for t in m.tensors}
    assert {"model.layers.1.self_attn.sinks", "model.layers.1.self_attn.o_proj.bias", "model.layers.1.mlp.router.bias",
            "model.layers.1.mlp.experts.3.gate_proj.bias", "model.layers.1.mlp.experts.3.down_proj.bias"} <= names


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt-oss"])
def test_windowed_rows_are_the_same_bits_in_any_batch(checkpoints, name):
    """Sliding windows and soft caps keep issue 26's batch invariance on the default dtype: a
    decode row past its window gives the same bits alone, among other decode rows and beside
    prefill chunks, and a prompt's last logits are the same bits however it was chunked."""
    path, _, _ = checkpoints(name)
    runner = ModelRunner.from_dir(path, num_blocks=160, block_size=4, ops=NumbaOps("q8_0"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (30, 17, 41, 9, 26)]
    tables = [list(range(16 * i, 16 * (i + 1))) for i in range(10)]
    for i, prompt in enumerate(prompts):
        runner.logits(StepPlan([Row(i, prompt, 0, tables[i])]))

    def decode(i):
        return Row(i, [5 + i], len(prompts[i]), tables[i], sample=True)

    def first(rows):
        return np.asarray(runner.logits(StepPlan(rows)))[0]

    alone = first([decode(0)])
    np.testing.assert_array_equal(first([decode(0), *map(decode, range(1, 5))]), alone)
    chunk = Row("p", rng.integers(3, 256, 23).tolist(), 0, tables[6], sample=True)
    np.testing.assert_array_equal(first([decode(0), chunk, decode(3)]), alone)
    prompt = prompts[2]
    whole = first([Row("w", prompt, 0, tables[7], sample=True)])
    for start, end in ((0, 13), (13, 14), (14, 40)):
        runner.logits(StepPlan([Row("c", prompt[start:end], start, tables[8]), decode(1)]))
    np.testing.assert_array_equal(first([Row("c", prompt[40:], 40, tables[8], sample=True)]), whole)
