"""tools/make_model.py: random-weight models in real shapes, read back by Spool and by gguf-py."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from model.gguf.convert import convert_gguf
from model.runner import ModelRunner, Row, StepPlan
from model.tokenizer import Tokenizer
from model.weights import read_model_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_model  # noqa: E402

T = gguf.GGMLQuantizationType
TINY = make_model.SHAPES["tiny"]
TEXT = "The capital of France is Paris. Über Größe, 東京 and 🎉; def f(x): return 42\n"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """make(fmt, kind) -> the path of the tiny model in that format and type, made once."""
    root, cache = tmp_path_factory.mktemp("made"), {}

    def make(fmt: str, kind: str) -> Path:
        if (fmt, kind) not in cache:
            out = root / (f"tiny-{kind}.gguf" if fmt == "gguf" else f"tiny-{kind}")
            make_model.main(["--shape", "tiny", "--format", fmt, "--type", kind, "--out", str(out)])
            cache[fmt, kind] = out
        return cache[fmt, kind]

    return make


def run_forward(model_dir: Path) -> np.ndarray:
    runner = ModelRunner.from_dir(model_dir, num_blocks=16)
    ids = Tokenizer(model_dir).encode(TEXT)[:12]
    table = list(range(-(-len(ids) // runner.block_size)))
    logits = np.asarray(runner.logits(StepPlan([Row("a", ids, 0, table, sample=True)])))
    assert logits.shape == (1, TINY.vocab)
    assert np.isfinite(logits).all() and logits.std() > 0
    return logits


@pytest.mark.parametrize("kind", ["q4_k_m", "q8_0"])
def test_gguf_read_back_by_gguf_py(made, kind):
    reader = gguf.GGUFReader(made("gguf", kind))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert len(types) == 2 + 9 * TINY.layers + 1
    assert all(types[n] == T.F32 for n in types if n.endswith("norm.weight"))
    matrices = {n: q for n, q in types.items() if not n.endswith("norm.weight")}
    if kind == "q8_0":
        assert set(matrices.values()) == {T.Q8_0}
    else:  # layer 1 of 2 is in use_more_bits, layer 0 is not
        more = {"output.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
        assert {n for n, q in matrices.items() if q == T.Q6_K} == more
        assert all(q == T.Q4_K for n, q in matrices.items() if n not in more)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [TINY.hidden, TINY.vocab]
    w = gguf.quants.dequantize(embd.data, embd.tensor_type)
    assert np.isfinite(w).all() and 0.8 < w.std() * TINY.hidden ** 0.5 < 1.2


@pytest.mark.parametrize("kind", ["q4_k_m", "q8_0"])
def test_gguf_converts_tokenizes_and_runs(made, kind, tmp_path):
    model_dir = convert_gguf(made("gguf", kind), tmp_path / "converted")
    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.decode([TINY.vocab - 1]) == f"[PAD{TINY.vocab - 1}]"  # padding decodes as written
    run_forward(model_dir)


def test_the_q4_k_m_mix_is_served_in_place_by_the_cpu_backend(made, tmp_path):
    """Layer 1's Q6_K attn_v beside Q4_K attn_q/k: that layer's q/k/v are read as a Fused of
    two parts (q and k stacked, v), layer 0's (all Q4_K) as one stack of blocks; the logits stay
    within 2% of the float32 path's range (about 1% when measured, every K type rounded to Q8_0 here) and pick the same
    token."""
    from model.config import ModelConfig
    from model.ops.numba_ops import NumbaOps
    from model.ops.numpy_ops import NumpyOps
    from model.quant.quantized import Fused, QuantizedTensor
    from model.weights import load_weights

    model_dir = convert_gguf(made("gguf", "q4_k_m"), tmp_path / "converted")
    read = load_weights(model_dir, ModelConfig.load(model_dir), lambda w: w).layers
    assert isinstance(read[0].wqkv, QuantizedTensor) and read[0].wqkv.kind == "q4_k"
    assert isinstance(read[1].wqkv, Fused) and [p.kind for p in read[1].wqkv.parts] == ["q4_k", "q6_k"]
    ids = Tokenizer(model_dir).encode(TEXT)[:12]
    plan = StepPlan([Row("a", ids, 0, [0], sample=True)])
    kept = ModelRunner.from_dir(model_dir, num_blocks=4, ops=NumbaOps("q8_0"))
    want = np.asarray(ModelRunner.from_dir(model_dir, num_blocks=4, ops=NumpyOps()).logits(plan)[0])
    got = np.asarray(kept.logits(plan)[0])
    assert np.abs(got - want).max() <= 0.02 * np.ptp(want)
    assert got.argmax() == want.argmax()


def test_gguf_and_hf_are_twins(made, tmp_path):
    """The same seed draws the same weights in both formats, q/k rows permuted into llama.cpp's
    rope layout in the GGUF and back by the converter."""
    converted = read_model_tensors(convert_gguf(made("gguf", "q8_0"), tmp_path / "c"))
    hf = read_model_tensors(made("hf", "f32"))
    assert converted.keys() == hf.keys()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "lm_head.weight", "model.norm.weight"):
        a, b = np.asarray(converted[name], np.float32), np.asarray(hf[name], np.float32)
        assert np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)) < 0.01, name


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_hf_directory_loads_and_runs(made, kind):
    model_dir = made("hf", kind)
    assert Tokenizer(model_dir).decode(Tokenizer(model_dir).encode(TEXT)) == TEXT
    run_forward(model_dir)


def test_q4_k_m_mix_in_the_1b_shape():
    """llama-quantize's choice for 16 layers: attn_v and ffn_down get Q6_K in layers 0, 1, 4, 7,
    10, 13, 14, 15; the tied embedding serves as the output, so it gets Q6_K too."""
    s = make_model.SHAPES["llama3.2-1b"]
    types = {t.gguf_name: make_model.tensor_type(t, "q4_k_m", s) for t in make_model.tensors(s)}
    assert types["token_embd.weight"] == T.Q6_K and "output.weight" not in types
    for suffix in ("attn_v.weight", "ffn_down.weight"):
        assert [i for i in range(16) if types[f"blk.{i}.{suffix}"] == T.Q6_K] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(16)} == {T.Q4_K}
    s8 = make_model.SHAPES["llama3.1-8b"]
    types = {t.gguf_name: make_model.tensor_type(t, "q4_k_m", s8) for t in make_model.tensors(s8)}
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K


def test_rows_that_do_not_fill_super_blocks_fall_back():
    s = make_model.Shape("llama", 320, 1, 5, 1, 64, 640, 1000, True, 1e4, 1e-5, 256)
    types = {t.gguf_name: make_model.tensor_type(t, "q4_k_m", s) for t in make_model.tensors(s)}
    assert types["blk.0.attn_q.weight"] == T.Q5_0 and types["token_embd.weight"] == T.Q8_0
    assert make_model.tensor_type(make_model.tensors(s)[1], "q4_k_m", s) == T.F32  # a norm


def test_real_shapes_match_their_models():
    counts = {name: sum(int(np.prod(t.shape)) for t in make_model.tensors(s))
              for name, s in make_model.SHAPES.items()}
    assert round(counts["llama3.2-1b"] / 1e9, 2) == 1.24
    assert round(counts["llama3.1-8b"] / 1e9, 2) == 8.03
    assert round(counts["qwen3-4b"] / 1e9, 2) == 4.02


@pytest.mark.parametrize("arch,kind", [("qwen3", "q4_k_m"), ("llama", "q4_0")])
def test_other_architectures_and_rope(arch, kind, tmp_path):
    """A tied Qwen3 (q/k norms, head_dim 128 against 256 / 4 heads) and a Llama with Llama 3
    rope scaling: converted, they keep their shape and rope, and run."""
    import dataclasses
    import json

    s = dataclasses.replace(TINY, arch=arch, tied=True, head_dim=128 if arch == "qwen3" else 64,
                            llama3_rope=None if arch == "qwen3" else (8.0, 1.0, 4.0, 8192), rope_theta=500000.0)
    path = tmp_path / "m.gguf"
    make_model.write_gguf(path, s, kind, 0, "test")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == (T.Q6_K if kind == "q4_k_m" else T.Q4_0)
    assert ("blk.0.attn_q_norm.weight" in types) == (arch == "qwen3")
    model_dir = convert_gguf(path, tmp_path / "converted")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == (arch, s.head_dim, True)
    if arch == "llama":
        assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    run_forward(model_dir)


def test_a_gpt_oss_shape_with_mxfp4_experts_runs(tmp_path):
    """GPT-OSS-20B's tensors at a tiny width: MXFP4 experts (their bytes as drawn), every other
    matrix Q8_0, biases, sinks and routers F32; Spool reads its window, YaRN and experts, and runs."""
    import dataclasses

    s = dataclasses.replace(make_model.SHAPES["gpt-oss-20b"], hidden=256, layers=2, heads=4, kv_heads=2,
                            ffn=256, expert_ffn=256, experts=4, experts_used=2, vocab=TINY.vocab)
    path = tmp_path / "oss.gguf"
    make_model.write_gguf(path, s, "mxfp4", 0, "test")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == T.MXFP4 and types["blk.1.attn_q.weight"] == T.Q8_0
    assert types["blk.1.ffn_down_exps.bias"] == types["blk.1.attn_sinks.weight"] == T.F32
    model_dir = convert_gguf(path, tmp_path / "converted")
    from model.config import ModelConfig

    c = ModelConfig.load(model_dir)
    assert c.layer_windows == (128, 0) and c.rope_scaling["factor"] == 32.0 and c.swiglu_clamp == (1.702, 7.0)
    run_forward(model_dir)
