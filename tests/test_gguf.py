"""GGUF -> Hugging Face directory conversion (model/gguf/), on tiny GGUFs built here; the
weights stay in the GGUF (tests/test_gguf_in_place.py serves them)."""

import json
import random
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer

import model.gguf.convert as mg
from model.errors import ModelError
from model.gguf.convert import convert_gguf
from model.gguf.rope import llama3_rope_factors
from tiny_gguf import (
    CHAT_TEMPLATE, CORPUS, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SPECIALS, export_vocab,
    gguf_name, hf_weights, permute_for_gguf, tiny_gguf, train_bpe, write_gguf,
)

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing  ",
    "digits 1234567 and 3.14159",
    "Üníçødé: 東京 🎉🚀 ok",
    "tabs\tand\nnewlines\n\n\nend",
    "It's we're I'm you'll",
    "<|im_start|>user\nhello<|im_end|>",
]


def load_weights(d: Path) -> dict[str, np.ndarray]:
    """Every tensor as float32, read through the directory's model.gguf."""
    from model.weights import read_model_tensors

    return read_model_tensors(d)


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg
    return msg


def leftovers(parent: Path, name: str) -> list[Path]:
    return list(parent.glob(f".{name}.tmp-*"))


def test_permutation_helpers_are_inverse():
    w = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    p = permute_for_gguf(w, HEADS)
    assert not np.array_equal(p, w)
    back = p.reshape(HEADS, p.shape[0] // HEADS // 2, 2, 3).swapaxes(1, 2).reshape(p.shape)
    np.testing.assert_array_equal(back, w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_and_config(tmp_path, arch, tied):
    src, _, weights = tiny_gguf(tmp_path / "m.gguf", arch=arch, tied=tied)
    out = convert_gguf(src, tmp_path / "out")
    assert out == tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.gguf", "tokenizer.json", "tokenizer_config.json",
    ]
    assert (out / "model.gguf").resolve() == src.resolve()
    got = load_weights(out)
    assert set(got) == set(weights)
    for name, want in weights.items():
        # Exact: the file's float32 values, q/k rows un-permuted.
        np.testing.assert_array_equal(got[name], want, err_msg=name)

    cfg = json.loads((out / "config.json").read_text())
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert cfg["architectures"] == [names[arch]]
    assert cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 256
    assert cfg["vocab_size"] == 400
    assert cfg["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in got) is (not tied)
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert cfg["torch_dtype"] == "float16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_metadata_holds_the_config_the_converted_directory_loads(tmp_path, arch):
    """GGUF metadata read once into a typed value: its ModelConfig is the one config.json gives."""
    from model.config import ModelConfig
    from model.gguf.metadata import read_gguf

    src, _, weights = tiny_gguf(tmp_path / "m.gguf", arch=arch, tied=False)
    meta = read_gguf(src)
    assert meta.config == ModelConfig.load(convert_gguf(src, tmp_path / "out"))
    assert {e.hf_name for e in meta.tensors} == set(weights)
    assert {e.hf_name: e.permute_heads for e in meta.tensors if e.permute_heads} == (
        {f"model.layers.{i}.self_attn.{x}_proj.weight": n for i in range(LAYERS) for x, n in (("q", HEADS), ("k", KV_HEADS))}
        if arch == "llama" else {})


def test_quantized_weights_are_unpermuted_after_dequantizing(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    src, _, weights = tiny_gguf(tmp_path / "m.gguf", quant=q8)
    got = load_weights(convert_gguf(src, tmp_path / "out"))
    for name, want in weights.items():
        tol = 0.02 * np.abs(want).max() if want.ndim == 2 else 0
        np.testing.assert_allclose(got[name].astype(np.float32), want, atol=tol + 2e-3, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "default"])
def test_bpe_tokenizer_matches_the_original(tmp_path, pre):
    src, ref, _ = tiny_gguf(tmp_path / "m.gguf", pre=pre)
    out = convert_gguf(src, tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == ref.get_vocab_size()
    for text in TEXTS + CORPUS[:5]:
        ids = tok.encode(text).ids
        assert ids == ref.encode(text).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # Control tokens are single special tokens, skipped on request.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_tokenizer_config_and_chat_template(tmp_path):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    out = convert_gguf(src, tmp_path / "out")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE
    assert (tc["bos_token"], tc["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tc["add_bos_token"] is False
    assert tc["model_max_length"] == 256
    text = jinja2.Environment().from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1


def test_add_bos_token_adds_bos_when_encoding(tmp_path):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf", add_bos=True, bos=0)
    out = convert_gguf(src, tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hello").ids[0] == 0
    assert tok.encode("hello", add_special_tokens=False).ids[0] != 0
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


# --- SentencePiece ("llama") tokenizers ---------------------------------------------------------

SPM_PIECES = (
    list("▁abcdefghilmnoprstuwy")
    + "▁t th ▁th he ▁the in er ▁a an ▁an nd ▁and ll lo llo ▁he ▁hel ▁hello or ▁w ▁wor ld ▁world"
      " es st est ing ▁s ▁is is ▁i it ▁it at ▁at re ▁re ar ▁p ▁pa ri ris ▁Pa".split()
)


def spm_vocab(seed=0):
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    merged_scores = rng.sample(range(1, 1000), len(SPM_PIECES))
    for piece, s in zip(SPM_PIECES, merged_scores):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(s) if len(piece) > 1 else -5000.0)
    return tokens, types, scores


def spm_reference_encode(text, tokens, types, scores):
    """SentencePiece BPE as llama.cpp runs it: merge the best-scoring adjacent pair, leftmost first."""
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, types) if ty == 1}
    symbols = list("▁" + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            m = symbols[i] + symbols[i + 1]
            if m in normal and (best is None or scores[ids[m]] > best[0]):
                best = (scores[ids[m]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for s in symbols:
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in s.encode())
    return out


def test_sentencepiece_tokenizer(tmp_path):
    tokens, types, scores = spm_vocab()
    weights = hf_weights("llama", vocab=len(tokens))
    src = write_gguf(tmp_path / "spm.gguf", weights, tokens=tokens, token_types=types, scores=scores,
                     tokenizer_model="llama", pre=None, bos=1, eos=2, add_bos=True, chat_template=None)
    out = convert_gguf(src, tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    hello = tok.encode("hello world", add_special_tokens=False)
    assert hello.tokens == ["▁hello", "▁world"]
    assert tok.encode("hello world").ids[0] == 1  # add_bos_token
    rng = random.Random(1)
    alphabet = "abcdehilnoprstw   Pé€"
    texts = ["hello world", "the Paris", "it is at the", "€uro café", " x", "é"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))) for _ in range(200)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == spm_reference_encode(text, tokens, types, scores), text
        assert tok.decode(ids) == text, text
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert "chat_template" not in tc


# --- rope scaling -------------------------------------------------------------------------------


def test_llama3_rope_freqs_map_to_rope_scaling(tmp_path):
    freqs = llama3_rope_factors(HEAD_DIM, 500000.0, 32.0, 1.0, 4.0, 8192).astype(np.float32)

    def kv(w):
        w.add_rope_freq_base(500000.0)

    src, _, _ = tiny_gguf(tmp_path / "m.gguf", extra_kv=kv, extra_tensors={"rope_freqs.weight": freqs})
    cfg = json.loads((convert_gguf(src, tmp_path / "out") / "config.json").read_text())
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in load_weights(tmp_path / "out")


def test_unknown_rope_freqs_are_refused(tmp_path):
    freqs = np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)
    src, _, _ = tiny_gguf(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "rope_freqs" in one_line(e)
    assert not (tmp_path / "out").exists()


def test_linear_rope_scaling(tmp_path):
    def kv(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    src, _, _ = tiny_gguf(tmp_path / "m.gguf", extra_kv=kv)
    cfg = json.loads((convert_gguf(src, tmp_path / "out") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# --- errors and atomicity -----------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelError) as e:
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert "does not exist" in one_line(e)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("this is not a gguf file at all\n")
    with pytest.raises(ModelError) as e:
        convert_gguf(p, tmp_path / "out")
    assert "not a readable GGUF" in one_line(e)


@pytest.mark.parametrize("keep", [0, 10, 0.3, 0.9])
def test_truncated_gguf(tmp_path, keep):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    data = src.read_bytes()
    n = keep if isinstance(keep, int) else int(len(data) * keep)
    src.write_bytes(data[:n])
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "m.gguf" in one_line(e)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path, "out") == []


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    real = mg._write_json
    calls = []

    def flaky(*a):
        calls.append(a)
        if len(calls) == 2:
            raise ModelError("simulated failure")
        return real(*a)

    monkeypatch.setattr(mg, "_write_json", flaky)
    with pytest.raises(ModelError, match="simulated"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path, "out") == []


def test_existing_output_dir_is_refused(tmp_path):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "already exists" in one_line(e)


def test_losing_a_race_keeps_the_winners_copy(tmp_path, monkeypatch):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    real = mg._fsync_path

    def racing(*a, **kw):
        real(*a, **kw)
        out.mkdir()  # another process finishes first
        (out / "config.json").write_text("{\"winner\": true}")

    monkeypatch.setattr(mg, "_fsync_path", racing)
    assert convert_gguf(src, out) == out
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert leftovers(tmp_path, "out") == []


def test_unsupported_architecture(tmp_path):
    tok = train_bpe()
    tokens, merges = export_vocab(tok)
    src = write_gguf(tmp_path / "m.gguf", hf_weights(vocab=len(tokens)), arch="gpt2", tokens=tokens, merges=merges)
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "'gpt2'" in one_line(e) and "not supported" in str(e.value)


def test_unsupported_tokenizer_model(tmp_path):
    tok = train_bpe()
    tokens, merges = export_vocab(tok)
    src = write_gguf(tmp_path / "m.gguf", hf_weights(vocab=len(tokens)), tokens=tokens, merges=merges,
                     tokenizer_model="t5")
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "'t5'" in one_line(e) and "gpt2, llama, gemma4, bert" in one_line(e)


def test_unknown_tensor_is_refused(tmp_path):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ModelError) as e:
        convert_gguf(src, tmp_path / "out")
    assert "ffn_gate_exps" in one_line(e)


def test_special_tokens_are_single_ids(tmp_path):
    src, _, _ = tiny_gguf(tmp_path / "m.gguf")
    tok = Tokenizer.from_file(str(convert_gguf(src, tmp_path / "out") / "tokenizer.json"))
    for i, s in enumerate(SPECIALS):
        assert tok.encode(s).ids == [i]
