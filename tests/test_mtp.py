"""Qwen3.5's multi-token-prediction layer as speculation's proposer (model/mtp.py): its guesses are
the ones a from-scratch NumPy reading of the layer makes, the K/V it keeps beside the model's
follows the request through chunks, preemption and spills, and no request gets a token it would
not get without it, greedy or seeded, alone or in a batch, dense or with experts."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from app.engine.speculation import SpeculativeConfig
from cuda_harness import CpuLauncher
from engine_harness import Harness
from model.errors import ModelError
from model.mtp import MTP
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from family_models import FAMILIES, make_family, mtp_tensors  # noqa: E402


def with_mtp(name: str, path: Path, tiny_dir: Path, echo: bool = False) -> Path:
    """The tiny random family `name` with a random MTP layer; echo: its LM head is its embedding
    and the MTP layer passes the embedding of its input token straight through, so that it
    guesses "the token before again", which the model's repeating greedy output often keeps."""
    path, _ = make_family(name, path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / file, path / file)
    tensors = {**load_file(path / "model.safetensors"), **mtp_tensors(FAMILIES[name][0])}
    if echo:
        h = tensors["model.embed_tokens.weight"].shape[1]
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["mtp.fc.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
        for name in tensors:
            if name.startswith("mtp.") and name.endswith(("o_proj.weight", "down_proj.weight", "norm.weight")):
                tensors[name] = np.zeros_like(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, tiny_dir):
    made = {}

    def get(name, echo=False):
        if (name, echo) not in made:
            made[name, echo] = with_mtp(name, tmp_path_factory.mktemp(name), tiny_dir, echo)
        return made[name, echo]
    return get


# --- the layer against a from-scratch reading of it ----------------------------------------------

def norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def rotate(x, positions, rotated, theta=10000.0):
    """HF's rotate_half on each head's first `rotated` dims (Qwen3.5's partial rotation)."""
    inv = 1.0 / theta ** (np.arange(0, rotated, 2) / rotated)
    angles = positions[:, None] * inv[None]
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, None] for f in (np.cos, np.sin))
    xr, rest = x[..., :rotated], x[..., rotated:]
    half = rotated // 2
    turned = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return np.concatenate([xr * cos + turned * sin, rest], -1)


def reference_mtp(t, config, hidden, following):
    """The MTP layer over a whole sequence at once, in float64: hidden[j] the model's final
    hidden state at position j, following[j] the token after it; the logits at every position."""
    c = config
    H, heads, kv, D = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    m = lambda name: t["mtp." + name].astype(np.float64)  # noqa: E731
    n = len(following)
    e = norm(t["model.embed_tokens.weight"][following].astype(np.float64), m("pre_fc_norm_embedding.weight"))
    x = np.concatenate([e, norm(hidden, m("pre_fc_norm_hidden.weight"))], 1) @ m("fc.weight").T
    a = "layers.0.self_attn."
    h = norm(x, m("layers.0.input_layernorm.weight"))
    q, gate = np.split((h @ m(a + "q_proj.weight").T).reshape(n, heads, 2 * D), 2, axis=-1)
    k = (h @ m(a + "k_proj.weight").T).reshape(n, kv, D)
    v = (h @ m(a + "v_proj.weight").T).reshape(n, kv, D)
    rotated = int(D * c["rope_parameters"]["partial_rotary_factor"])
    q = rotate(norm(q, m(a + "q_norm.weight")), np.arange(n), rotated)
    k = np.repeat(rotate(norm(k, m(a + "k_norm.weight")), np.arange(n), rotated), heads // kv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) + np.triu(np.full((n, n), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), np.repeat(v, heads // kv, axis=1))
    attn = attn * (1 / (1 + np.exp(-gate)))
    x = x + attn.reshape(n, heads * D) @ m(a + "o_proj.weight").T
    h = norm(x, m("layers.0.post_attention_layernorm.weight"))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    up = silu(h @ m("layers.0.mlp.gate_proj.weight").T) * (h @ m("layers.0.mlp.up_proj.weight").T)
    x = x + up @ m("layers.0.mlp.down_proj.weight").T
    out = norm(x, m("norm.weight"))
    return out @ t["lm_head.weight"].astype(np.float64).T, out


# the layer on each backend: float32 weights (int16 activations on the CPU's kernels)
BACKENDS = {"numpy": NumpyOps, "numba": lambda: NumbaOps("float32", "int16"),
            "cuda-harness": lambda: CudaOps(np, CpuLauncher())}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_guesses_are_the_layers_own(mtp_dirs, backend):
    """After a prompt's prefill, the request's guesses (three, each fed the one before and the
    layer's own output) are the argmax of a from-scratch reading of the layer, fed the model's
    final hidden states and the tokens that follow each position."""
    path = mtp_dirs("qwen3.5")
    config = FAMILIES["qwen3.5"][0]
    tensors = load_file(path / "model.safetensors")
    runner = ModelRunner.from_dir(path, num_blocks=32, block_size=4, ops=BACKENDS[backend](), state_slots=2,
                                  extra_layers=1)
    runner.draft = MTP.load(path, runner, count=3)
    prompt = [int(i) for i in np.random.default_rng(3).integers(3, 256, 21)]
    rows = [Row("a", prompt, 0, list(range(8)), sample=True, prompt_ids=prompt, state_slot=0)]
    launched = runner.launch(StepPlan(rows))
    hidden = runner.ops.to_host(launched.followed[1]).astype(np.float64)
    first = runner.collect(launched)[0].token_id
    at, guesses = runner.draft.guesses["a"]
    assert at == len(prompt) and len(guesses) == 3
    following, states = [*prompt[1:], first], hidden
    for guess in guesses:
        logits, out = reference_mtp(tensors, config, states, following)
        assert guess == int(np.argmax(logits[-1]))
        following, states = [*following, guess], np.concatenate([states, out[-1:]])


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_a_gguf_s_nextn_block_guesses_as_the_checkpoint_does(mtp_dirs, name, tmp_path):
    """llama.cpp's converter's names for the layer (blk.N.*, blk.N.nextn.*), read from a GGUF of
    the same weights (F32): the same guesses as from the Hugging Face checkpoint."""
    from family_gguf import write_family_gguf
    from model.gguf.convert import convert_gguf

    served = convert_gguf(write_family_gguf(name, tmp_path / "mtp.gguf", mtp=True), tmp_path / "served")
    prompt = [int(i) for i in np.random.default_rng(4).integers(3, 256, 17)]
    made = []
    for path in (mtp_dirs(name), served):
        runner = ModelRunner.from_dir(path, num_blocks=32, block_size=4, ops=NumpyOps(), state_slots=1,
                                      extra_layers=1)
        runner.draft = MTP.load(path, runner, count=3)
        runner.step(StepPlan([Row("a", prompt, 0, list(range(8)), sample=True, prompt_ids=prompt, state_slot=0)]))
        made.append(runner.draft.guesses["a"])
    assert made[0] == made[1] and len(made[0][1]) == 3


def test_a_checkpoint_without_the_layer_is_refused_in_one_line(tmp_path, tiny_dir):
    path, _ = make_family("qwen3.5", tmp_path / "plain")
    runner = ModelRunner.from_dir(path, num_blocks=8, block_size=4, ops=NumpyOps(), state_slots=1, extra_layers=1)
    with pytest.raises(ModelError, match="no multi-token-prediction layer"):
        MTP.load(path, runner, count=1)


def test_the_config_defaults_to_one_guess_as_vllm_does():
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 1
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    with pytest.raises(ValueError, match="draft"):
        SpeculativeConfig.parse('{"method": "mtp", "model": "x"}')


# --- served: the engine with the proposer ---------------------------------------------------------

def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


PROMPTS = [prompt(n, seed) for n, seed in ((23, 10), (5, 11), (31, 12), (14, 13))]


def generate(path, prompts, spec=None, max_tokens=24, slots=4, num_blocks=96, seeds=None, **config):
    speculative = SpeculativeConfig.parse(spec) if spec else None
    runner = ModelRunner.from_dir(path, num_blocks=num_blocks, block_size=4, ops=NumbaOps("q8_0"), state_slots=slots,
                                  extra_layers=1 if speculative else 0)
    proposed = {}  # request -> {a row's start: the guesses it carried}
    if speculative:
        runner.draft = MTP.load(path, runner, speculative.num_speculative_tokens)
        propose = runner.draft.propose

        def logged(rows):
            propose(rows)
            for r in rows:
                if r.num_draft:
                    proposed.setdefault(r.request_id, {})[r.start_pos] = list(r.token_ids[1:])
        runner.draft.propose = logged
    h = Harness(runner, Tokenizer(path), speculative=speculative, **config)
    rids = [h.submit(p, max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0)
                     if seeds is None else SamplingParams(temperature=1.0, seed=seeds[i]))
            for i, p in enumerate(prompts)]
    h.run()
    h.proposed = [proposed.get(r, {}) for r in rids]
    assert h.pool.used == 0 and h.planner.tables.slots.used == 0
    assert not runner.draft or not runner.draft.guesses  # every request's guesses dropped at its end
    return [h.tokens(r) for r in rids], h


MTP3 = '{"method": "mtp", "num_speculative_tokens": 3}'


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_speculation_changes_no_token(mtp_dirs, name, seeded):
    """Greedy and seeded requests in a batch, in small chunks: the same tokens with the MTP
    layer's guesses as without, and guesses were kept."""
    path = mtp_dirs(name, echo=True)
    seeds = range(len(PROMPTS)) if seeded else None
    want, _ = generate(path, PROMPTS, seeds=seeds, prefill_chunk=64)
    got, h = generate(path, PROMPTS, MTP3, seeds=seeds, prefill_chunk=7)
    counters = h.planner.speculation.stats
    assert got == want
    assert counters.draft_tokens > counters.accepted_tokens > (0 if seeded else 5), counters


@pytest.mark.parametrize("swap_blocks", [0, 64], ids=["recompute", "spill"])
def test_preemption_keeps_or_rebuilds_the_layers_kv(mtp_dirs, swap_blocks):
    """A pool too small for every request at once: a victim's MTP K/V goes to the host with its
    blocks, or is rebuilt with the model's by recomputing. Its tokens are what it gets alone, and
    so are the layer's guesses (its attention reads that K/V) wherever both runs guessed."""
    path = mtp_dirs("qwen3.5")
    alone = [generate(path, [p], MTP3, prefill_chunk=64)[1].proposed[0] for p in PROMPTS]
    want = [generate(path, [p])[0][0] for p in PROMPTS]
    tokens, h = generate(path, PROMPTS, MTP3, num_blocks=20, prefill_chunk=64, immunity_tokens=2,
                         swap_blocks=swap_blocks)
    assert h.stats.preemptions > 0
    assert tokens == want
    compared = 0
    for got, solo in zip(h.proposed, alone):
        for at in set(got) & set(solo):  # as many as both carried: a full pool lets a row guess fewer
            n = min(len(got[at]), len(solo[at]))
            assert got[at][:n] == solo[at][:n], at
            compared += n
    assert compared >= 8, compared


def test_a_server_with_mtp_writes_the_same_text_and_counts_it(mtp_dirs):
    """`spool serve --speculative-config '{"method": "mtp"}'` on a Qwen3.5 checkpoint, against one
    without: the same greedy tokens over the official client, and guesses kept in /metrics."""
    from live_server import LiveServer

    path = mtp_dirs("qwen3.5", echo=True)
    got, counters = [], {}
    for flags in ((), ("--speculative-config", MTP3)):
        server = LiveServer(str(path), "--dtype", "q8_0", "--kv-cache-gib", "0.05", *flags)
        try:
            with server.openai_client() as client:
                got.append([client.completions.create(model=path.name, prompt=p, max_tokens=24, temperature=0,
                                                      logprobs=0).choices[0].logprobs.tokens for p in PROMPTS])
            counters = {k: v for k, v in server.metrics().items() if "spec_decode" in k}
        finally:
            assert server.stop() == 0, server.output()
    assert got[0] == got[1] and all(got[0])
    accepted = next(v for k, v in counters.items() if k.startswith("spool:spec_decode_num_accepted_tokens_total"))
    assert accepted > 5
