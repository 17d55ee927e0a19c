"""--dtype q4_k on the CPU (issue 26, part 3): a Hugging Face checkpoint's float weights quantized
while loading by Spool's own Q4_K quantizer (model/quant/kquants.py) and packed as a GGUF's
Q4_K tensor is (model/quant/kblocks.py); checked against gguf-py's dequantizer."""

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

from model.backend import resolve
from model.gguf.convert import convert_gguf
from model.quant import kquants, pack, quantized
from model.quant.matmul import matmul
from model.quant.quantized import FloatRows
from model.quant.strips import Q4_1Strips, Q4_KStrips, Q8_0Strips
from model.runner import ModelRunner, Row, StepPlan
from model.safetensors_files import ModelTensors
from reference import int8_activations
from test_kblocks import TOLERANCE
from tiny_gguf import tiny_gguf
from tiny_model import make_tiny_model

Q4_K = gguf.GGMLQuantizationType.Q4_K
PROMPT = [5, 9, 30, 41, 7, 100, 3, 250]


def weight(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows of very different magnitudes, one of them zero."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, columns), dtype=np.float32) * rng.choice([1e-3, 0.05, 3], rows)[:, None]
    w[rows // 2] = 0
    return w.astype(np.float32)


def rows_of(w: np.ndarray) -> FloatRows:
    def read_into(first, out):
        out[...] = w[first:first + len(out)]

    return FloatRows(w.shape, read_into)


@pytest.mark.parametrize("rows, columns", [(1, 256), (37, 512), (100, 768)])
def test_the_strips_are_what_gguf_py_dequantizes(rows, columns):
    w = weight(rows, columns)
    strips = pack.compress(w, "q4_k")
    want = gguf.quants.dequantize(kquants.quantize(w, Q4_K), Q4_K).reshape(rows, columns)
    assert type(strips) is Q4_KStrips and strips.shape == (rows, columns)
    np.testing.assert_array_equal(strips.dequantize().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("tokens", [1, 7, 33, 100])
def test_the_matmul_is_gguf_py_s_weights_times_x(tokens):
    """Within float rounding (test_kblocks), the activations rounded to int8 as the GEMV does."""
    w = weight(45, 768, seed=1)
    deq = gguf.quants.dequantize(kquants.quantize(w, Q4_K), Q4_K).reshape(w.shape)
    x = np.random.default_rng(tokens).standard_normal((tokens, 768), dtype=np.float32)
    want = int8_activations(x) @ deq.T
    got = matmul(x, pack.compress(w, "q4_k"))
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE * np.abs(want).max())


def test_rows_not_a_multiple_of_256_fall_back_to_q8_0():
    assert type(pack.compress(weight(32, 384), "q4_k")) is Q8_0Strips
    exact = np.tile(np.arange(16, dtype=np.float32) * np.float32(0.5), (32, 24))  # Q4_1 exactly: kept so
    assert type(pack.compress(exact, "q4_k")) is Q4_1Strips


def test_a_weight_read_in_slabs_packs_as_the_whole_does(monkeypatch):
    """FloatRows (an embedding, an LM head) are packed slab by slab: the same strips; and a weight
    whose first slab alone is Q4_1 exactly is Q8_0 throughout, as the whole would be."""
    monkeypatch.setattr(quantized, "SLAB_VALUES", 16 * 512)  # slabs of 16 rows
    w = weight(72, 512, seed=2)
    for kind in ("q8_0", "q4_k"):
        whole, slabbed = pack.compress(w, kind), pack.compress(rows_of(w), kind)
        assert type(slabbed) is type(whole)
        np.testing.assert_array_equal(slabbed.q, whole.q)
        np.testing.assert_array_equal(slabbed.factors, whole.factors)
    mixed = w.copy()
    mixed[:16] = np.tile(np.arange(16, dtype=np.float32), (16, 32))
    assert type(pack.compress(rows_of(mixed), "q8_0")) is Q8_0Strips
    np.testing.assert_array_equal(pack.compress(rows_of(mixed), "q8_0").q, pack.quantize(mixed).q)


def test_safetensors_rows_read_as_the_whole_tensor(tiny_dir):
    with ModelTensors(tiny_dir) as tensors:
        name = "model.embed_tokens.weight"
        whole, rows = tensors.read(name), tensors.rows(name)
        part = np.empty((7, whole.shape[1]), np.float32)
        rows.read_into(100, part)
        np.testing.assert_array_equal(part, whole[100:107])
        np.testing.assert_array_equal(rows.read(), whole)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny Llama whose every matrix has rows of a multiple of 256 (hidden 256, FFN 512), untied."""
    return make_tiny_model(tmp_path_factory.mktemp("wide"), hidden=256, intermediate=512, tie=False)


def logits(model_dir, dtype: str) -> tuple[np.ndarray, int]:
    """Logits at every position of PROMPT, and the weights' bytes."""
    model = resolve("cpu", dtype).load(model_dir)
    runner = ModelRunner(model.config, model, num_blocks=4)
    rows = [Row(p, [PROMPT[p]], p, [0], sample=True) for p in range(len(PROMPT))]
    out = np.concatenate([np.asarray(runner.logits(StepPlan([row]))) for row in rows])
    return out, model.weight_bytes


def dequantized_copy(model_dir, out):
    """model_dir with each matrix replaced by gguf-py's dequantization of its Q4_K bytes."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({n: gguf.quants.dequantize(kquants.quantize(t, Q4_K), Q4_K).reshape(t.shape) if t.ndim == 2 else t
               for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def test_a_tiny_model_in_q4_k(wide_dir, tmp_path):
    """Its logits are the float32 logits of gguf-py's dequantized Q4_K weights (within the
    kernels' tolerance); off the float32 model's by at most 20% of their range and 30% of their
    spread in RMS (0.12 and 0.23 measured, 4 bits of random weights through two layers; q8_0:
    0.009 and 0.018); and its weights hold 4.625 bits each."""
    got, q4_bytes = logits(wide_dir, "q4_k")
    exact, f32_bytes = logits(wide_dir, "float32")
    on_gguf_values, _ = logits(dequantized_copy(wide_dir, tmp_path / "dequantized"), "float32")
    scale = np.abs(on_gguf_values).max()
    np.testing.assert_allclose(got, on_gguf_values, rtol=0, atol=10 * TOLERANCE * scale)
    assert np.abs(got - exact).max() <= 0.2 * np.ptp(exact)
    assert np.sqrt(np.mean((got - exact) ** 2)) <= 0.3 * exact.std()

    with ModelTensors(wide_dir) as tensors:
        shapes = [e.shape for e in tensors.entries.values()]
    padded = sum(-(-s[0] // 16) * 16 * s[1] for s in shapes if len(s) == 2)  # strips of 16 rows
    matrices = sum(s[0] * s[1] for s in shapes if len(s) == 2)
    vectors = sum(s[0] for s in shapes if len(s) == 1)
    assert f32_bytes == 4 * (matrices + vectors)
    assert q4_bytes == padded * 4.625 / 8 + 4 * vectors
    assert abs(q4_bytes / f32_bytes - 4.625 / 32) < 0.003


def test_a_gguf_keeps_its_own_types_under_q4_k(tmp_path):
    """A Q8_0 GGUF served with --dtype q4_k is what q8_0 serves: the file's blocks."""
    src, _, _ = tiny_gguf(tmp_path / "m.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(src, tmp_path / "out")
    q4, q8 = (resolve("cpu", dtype).load(out).w for dtype in ("q4_k", "q8_0"))
    pairs = [(a, b) for got, want in [*zip(q4.layers, q8.layers), (q4, q8)]
             for a, b in zip(vars(got).values(), vars(want).values()) if isinstance(b, Q8_0Strips)]
    assert len(pairs) == 2 * 4 + 2  # each layer's four GEMMs, the embedding and the LM head (tied: the same)
    for got, want in pairs:
        assert type(got) is Q8_0Strips
        np.testing.assert_array_equal(got.q, want.q)


def test_the_cli_generates_with_q4_k(wide_dir):
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--model", str(wide_dir), "--backend", "cpu",
                           "--dtype", "q4_k", "--max-tokens", "4", "hi"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
