"""Loading without inflating: safetensors memory-mapped and read tensor by tensor (BF16, F16,
sharded), and a peak resident memory near the packed weights, not the float32 model."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.config import ModelConfig
from model.runner import ModelRunner, Row, StepPlan
from model.weights import load_weights, read_model_tensors


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (the file's dtype name, the array holding those bytes), written one by one."""
    header, offset = {}, 0
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_bf16_f16_and_shards_load_as_float32(tiny_dir, tmp_path):
    """Two shards, one BF16 and one F16: the same weights and logits as the float32 tensors they round to."""
    tensors = read_model_tensors(tiny_dir)
    names = sorted(tensors)
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    write_safetensors(d / "model-00001-of-00002.safetensors",
                      {n: ("BF16", bf16_bits(tensors[n])) for n in names[::2]})
    write_safetensors(d / "model-00002-of-00002.safetensors",
                      {n: ("F16", tensors[n].astype(np.float16)) for n in names[1::2]})
    rounded = {n: (bf16_bits(t).astype(np.uint32) << 16).view(np.float32) if i % 2 == 0 else
               t.astype(np.float16).astype(np.float32) for i, (n, t) in enumerate(sorted(tensors.items()))}
    assert all(np.array_equal(read_model_tensors(d)[n], rounded[n]) for n in names)
    np.testing.assert_array_equal(load_weights(d, ModelConfig.load(d)).layers[1].wqkv,
                                  np.concatenate([rounded[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))

    write_safetensors(tmp_path / "ref.safetensors", {n: ("F32", rounded[n]) for n in names})
    ref = tmp_path / "ref"
    shutil.copytree(d, ref, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.move(tmp_path / "ref.safetensors", ref / "model.safetensors")
    plan = StepPlan([Row("a", [5, 9, 30, 41], 0, [0], sample=True)])
    np.testing.assert_array_equal(ModelRunner.from_dir(d, num_blocks=4).logits(plan),
                                  ModelRunner.from_dir(ref, num_blocks=4).logits(plan))


def test_no_progress_bar_when_stderr_is_not_a_terminal(tiny_dir):
    proc = subprocess.run([sys.executable, "-c", "import sys; from model.backend import resolve;"
                           " resolve('cpu', 'q8_0').load(sys.argv[1])", str(tiny_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# hidden 1024, 8 layers, vocab 16000, untied: 490 MB of float32, 130 MB once packed to Q8_0
SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16000, "hidden_size": 1024,
         "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
         "tie_word_embeddings": False, "torch_dtype": "float32"}
# 4 layers, vocab 64000: 700 MB of float32, 200 MB once packed to Q8_0. The embedding and the LM
# head are 262 MB of float32 each, more than a layer (45 MB) and the bound's slack together: made
# float32 whole before packing, they grew the peak 437 MB past the weights and a layer (measured).
WIDE_VOCAB = SHAPE | {"vocab_size": 64000, "num_hidden_layers": 4}

# Loads the model in a fresh process; prints the resident growth at peak and what the weights hold.
# The peak is VmHWM, reset to the present RSS just before loading: ru_maxrss would also count the
# parent's resident memory, which execve folds into it.
MEASURE = """
import json, sys
import numpy as np
from model.backend import resolve
from model.config import ModelConfig
backend = resolve("cpu", sys.argv[2])
backend.prepare(ModelConfig.load(sys.argv[1])).weight(np.ones((64, 256), np.float32))  # the packing kernels
# loaded before the baseline
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = status("VmRSS")
model = backend.load(sys.argv[1])
print(json.dumps({"grew": status("VmHWM") - before, "weights": model.weight_bytes}))
"""


def make_checkpoint(d: Path) -> int:
    """A random float32 checkpoint of WIDE_VOCAB in d; returns the float32 bytes of its largest unit
    that loads at once: a layer (its fused tensors together). The embedding and the LM head never
    load at once: they are packed a slab of rows at a time."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(WIDE_VOCAB))
    c = ModelConfig.load(d)
    H, I = c.hidden_size, c.intermediate_size
    rng = np.random.default_rng(0)

    def matrix(rows, cols):
        return "F32", rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols ** -0.5)

    tensors = {"model.embed_tokens.weight": matrix(c.vocab_size, H), "lm_head.weight": matrix(c.vocab_size, H),
               "model.norm.weight": ("F32", np.ones(H, np.float32))}
    layer = {"self_attn.q_proj.weight": (c.q_size, H), "self_attn.k_proj.weight": (c.kv_size, H),
             "self_attn.v_proj.weight": (c.kv_size, H), "self_attn.o_proj.weight": (H, c.q_size),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + name: matrix(*shape) for name, shape in layer.items()}
        tensors |= {p + "input_layernorm.weight": ("F32", np.ones(H, np.float32)),
                    p + "post_attention_layernorm.weight": ("F32", np.ones(H, np.float32))}
    write_safetensors(d / "model.safetensors", tensors)
    return 4 * sum(rows * cols for rows, cols in layer.values())


def test_peak_memory_is_the_packed_weights_plus_one_layer(tmp_path):
    """Before loading went tensor by tensor, this grew by twice the float32 file; before the
    embedding and LM head went by slabs, by 437 MB more than the weights and a layer."""
    layer_bytes = make_checkpoint(tmp_path / "model")
    file_bytes = (tmp_path / "model" / "model.safetensors").stat().st_size
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "model"), "q8_0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    bound = got["weights"] + layer_bytes + (150 << 20)
    assert got["grew"] < bound < file_bytes, (got, layer_bytes, file_bytes)


def make_gguf_checkpoint(d: Path) -> int:
    """SHAPE as a Q8_0 GGUF of random blocks, in place in d (config.json beside it, as the cache
    holds it); returns the bytes of its largest unit's blocks (a layer, or the embedding)."""
    import gguf

    d.mkdir()
    (d / "config.json").write_text(json.dumps(SHAPE))
    c = ModelConfig.load(d)
    H, I = c.hidden_size, c.intermediate_size
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def blocks(rows, cols):
        b = rng.integers(-127, 128, (rows, cols // 32, 34), dtype=np.int8).view(np.uint8)
        b[:, :, :2] = np.full((rows, cols // 32, 1), cols ** -0.5 / 127, np.float16).view(np.uint8)
        return b.reshape(rows, -1)

    w = gguf.GGUFWriter(str(d / "model.gguf"), "llama")
    w.add_block_count(c.num_layers)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    layer = {"attn_q": (c.q_size, H), "attn_k": (c.kv_size, H), "attn_v": (c.kv_size, H), "attn_output": (H, c.q_size),
             "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
    w.add_tensor("token_embd.weight", blocks(c.vocab_size, H), raw_dtype=q8)
    w.add_tensor("output.weight", blocks(c.vocab_size, H), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i in range(c.num_layers):
        for name, shape in layer.items():
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(*shape), raw_dtype=q8)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 34 * max(sum(rows * cols for rows, cols in layer.values()), c.vocab_size * H) // 32


def test_a_gguf_in_place_peaks_at_the_packed_weights_plus_one_layer(tmp_path):
    """The file's pages go back to the page cache once read: without that the growth would be
    the packed weights plus the whole file."""
    unit_bytes = make_gguf_checkpoint(tmp_path / "model")
    file_bytes = (tmp_path / "model" / "model.gguf").stat().st_size
    measure = MEASURE.replace("model = backend.load", "import model.gguf.tensors, gguf\nmodel = backend.load")
    proc = subprocess.run([sys.executable, "-c", measure, str(tmp_path / "model"), "q8_0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["grew"] < got["weights"] + 2 * unit_bytes + (48 << 20) < got["weights"] + file_bytes, (got, file_bytes)
