"""LoRA adapters (model/lora.py): a random PEFT adapter's logits against the base weights with
the adapter merged in by NumPy (W + alpha / r * B A, PEFT's definition, on Hugging Face's names),
the GGUF form of the same adapter read to the same matrices, four adapters and the base model
in one batch each giving a row the tokens it gets alone, the prefix cache keeping each
adapter's K/V its own, and the server choosing adapters by model name, listing them, loading
and unloading them at run time, and refusing what it cannot do in one line."""

import json
import shutil
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model.config import ModelConfig
from model.lora import AdapterUse, read_adapter
from model.ops.cuda_ops import CudaOps
from model.ops.numba_ops import NumbaOps
from model.ops.numpy_ops import NumpyOps
from model.runner import ModelRunner, Row, StepPlan
from model.tokenizer import Tokenizer
from cuda_harness import CpuLauncher
from engine_harness import Harness
from live_server import LiveServer
from tiny_model import make_tiny_model

PROMPT = [5, 9, 33, 7, 100, 3, 41, 18, 250, 6, 77, 12, 13, 14, 90, 2, 60]  # over a block of 16
TARGETS = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
           "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    H, I, Q, KV = config.hidden_size, config.intermediate_size, config.q_size_of(0), config.kv_size_of(0)
    return {"q": (Q, H), "k": (KV, H), "v": (KV, H), "o": (H, Q), "gate": (I, H), "up": (I, H), "down": (H, I)}


def write_peft(path: Path, config: ModelConfig, seed: int, rank: int = 4, alpha: float = 8.0,
               modules=tuple(TARGETS), rslora: bool = False) -> dict[str, np.ndarray]:
    """A random PEFT adapter directory; its tensors (under PEFT's names)."""
    rng = np.random.default_rng(seed)
    sizes = shapes(config)
    tensors = {}
    for i in range(config.num_layers):
        for module in modules:
            out, width = sizes[TARGETS[module]]
            p = f"base_model.model.model.layers.{i}.{module}"
            tensors[p + ".lora_A.weight"] = (rng.standard_normal((rank, width)) / np.sqrt(width)).astype(np.float32)
            tensors[p + ".lora_B.weight"] = (0.3 * rng.standard_normal((out, rank))).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "bias": "none",
        "target_modules": sorted({m.split(".")[-1] for m in modules})}))
    return tensors


def merged_model(base: Path, out: Path, tensors: dict, scale: float) -> Path:
    """The base model with W + scale * B A for each adapted W, as PEFT's merge_and_unload writes it."""
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(base / "model.safetensors"))
    for name, a in tensors.items():
        if ".lora_A." in name:
            target = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            weights[target] = weights[target] + np.float32(scale) * (tensors[name.replace("lora_A", "lora_B")] @ a)
    save_file(weights, str(out / "model.safetensors"))
    return out


def llama_cpp_rope_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script's q/k row permutation (its LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(path: Path, config: ModelConfig, tensors: dict, alpha: float) -> Path:
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes it: GGUF names, q/k's B rows in
    its rope order, adapter.lora.alpha."""
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        parts = name.split(".")
        i, module = int(parts[4]), ".".join(parts[5:7])
        b = tensors[name.replace("lora_A", "lora_B")]
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            b = llama_cpp_rope_order(b, config.num_heads if "q_proj" in module else config.kv_heads_of(0))
        writer.add_tensor(f"blk.{i}.{names[module]}.weight.lora_a", a)
        writer.add_tensor(f"blk.{i}.{names[module]}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "base")


def logits(runner: ModelRunner, adapter=None) -> np.ndarray:
    return runner.logits(StepPlan([Row("x", PROMPT, 0, [0, 1], sample=True, adapter=adapter)]))


@pytest.mark.parametrize("ops", [NumpyOps, lambda: NumbaOps("float32")], ids=["numpy", "numba"])
@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_logits_match_the_merged_weights(base, tmp_path, ops, rslora):
    config = ModelConfig.load(base)
    tensors = write_peft(tmp_path / "adapter", config, seed=1, rslora=rslora)
    scale = 8.0 / (2.0 if rslora else 4.0)  # alpha / sqrt(r) or alpha / r
    runner = ModelRunner.from_dir(base, 8, ops=ops())
    runner.serve_adapters(2, 8)
    runner.load_adapter(read_adapter("a", tmp_path / "adapter", config), 1)
    merged = ModelRunner.from_dir(merged_model(base, tmp_path / "merged", tensors, scale), 8, ops=ops())
    want, plain = logits(merged), logits(runner)
    got = logits(runner, AdapterUse(1, 1.0, 1))
    assert np.abs(plain - want).max() > 0.5  # the adapter changes the logits
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    half = logits(runner, AdapterUse(1, 0.5, 2))  # a request's scale multiplies the adapter's
    half_merged = ModelRunner.from_dir(merged_model(base, tmp_path / "half", tensors, scale / 2), 8, ops=ops())
    np.testing.assert_allclose(half, logits(half_merged), atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_kernels_apply_adapters_as_numpy_does(base, tmp_path, dtype):
    """The forward pass through the CUDA kernels (the CPU harness) with two adapters and the
    base model in one batch, prefill then decode; with decode graphs captured, an adapted decode
    step runs eagerly (the graphs hold no slots) and a plain one still replays."""
    config = ModelConfig.load(base)
    runners = [ModelRunner.from_dir(base, 16, ops=NumpyOps()),
               ModelRunner.from_dir(base, 16, ops=CudaOps(np, CpuLauncher(), dtype))]
    runners[1].capture_graphs(4, 64)
    for seed, runner in enumerate(runners):
        runner.serve_adapters(2, 8)
        for slot in range(2):
            write_peft(tmp_path / f"a{slot}", config, seed=20 + slot, rank=4 + 4 * slot)
            runner.load_adapter(read_adapter(f"a{slot}", tmp_path / f"a{slot}", config), slot)
    uses = [AdapterUse(0, 1.0, 1), None, AdapterUse(1, 0.5, 2)]
    tolerance = {"float32": 1e-5, "bfloat16": 4e-2}[dtype]

    def compare(rows):
        want, got = (r.ops.to_host(r.logits(StepPlan(rows))) for r in runners)
        assert np.abs(got - want).max() / np.abs(want).max() < tolerance

    compare([Row(k, PROMPT[:10 + k], 0, [2 * k, 2 * k + 1], sample=True, adapter=uses[k]) for k in range(3)])
    replays = runners[1].graphs.replays
    compare([Row(k, [7 + k], 10 + k, [2 * k, 2 * k + 1], sample=True, adapter=uses[k]) for k in range(3)])
    assert runners[1].graphs.replays == replays
    compare([Row(1, [9], 12, [2, 3], sample=True)])
    assert runners[1].graphs.replays == replays + 1


def test_gguf_adapter_reads_as_its_peft_twin(base, tmp_path):
    config = ModelConfig.load(base)
    tensors = write_peft(tmp_path / "adapter", config, seed=2)
    peft = read_adapter("a", tmp_path / "adapter", config)
    ggml = read_adapter("b", write_gguf_adapter(tmp_path / "a.gguf", config, tensors, 8.0), config)
    assert ggml.rank == peft.rank == 4
    for mine, theirs in zip(ggml.layers, peft.layers):
        assert mine.keys() == theirs.keys() == {m.split(".")[-1] for m in TARGETS}
        for module in mine:
            np.testing.assert_array_equal(mine[module][0], theirs[module][0])
            np.testing.assert_array_equal(mine[module][1], theirs[module][1])


def test_four_adapters_and_the_base_in_one_batch(base, tmp_path):
    """Each request's greedy tokens in a batch with the others are those it gets alone, on the
    packed CPU kernels; a row's logits are the same bits alone and beside the others."""
    config = ModelConfig.load(base)
    runner = ModelRunner.from_dir(base, 64, ops=NumbaOps("q8_0"))
    runner.serve_adapters(4, 8)
    for slot in range(4):
        modules = tuple(TARGETS)[slot:slot + 4]  # each adapts other modules, at its own rank
        write_peft(tmp_path / f"a{slot}", config, seed=10 + slot, rank=2 + 2 * slot, modules=modules)
        runner.load_adapter(read_adapter(f"a{slot}", tmp_path / f"a{slot}", config), slot)
    uses = [None] + [AdapterUse(slot, 1.0, slot + 1) for slot in range(4)]
    prompts = [PROMPT[:n] for n in (17, 12, 9, 15, 6)]

    def generate(which):
        harness = Harness(runner, Tokenizer(base))
        ids = {k: harness.submit(prompts[k], max_tokens=12, ignore_eos=True, adapter=uses[k]) for k in which}
        harness.run()
        return {k: harness.tokens(rid) for k, rid in ids.items()}

    together = generate(range(5))
    for k in range(5):
        assert generate([k])[k] == together[k], k
    assert len({tuple(t) for t in together.values()}) > 1  # the adapters do change the output
    alone = [runner.logits(StepPlan([Row(k, prompts[k], 0, [8 + 2 * k, 9 + 2 * k], sample=True, adapter=uses[k])]))
             for k in range(5)]
    batch = runner.logits(StepPlan([Row(k, prompts[k], 0, [8 + 2 * k, 9 + 2 * k], sample=True, adapter=uses[k])
                                    for k in range(5)]))
    for k in range(5):
        np.testing.assert_array_equal(batch[k], alone[k][0])


def test_prefix_cache_keeps_each_adapters_blocks(base, tmp_path):
    """The same prompt under an adapter, then the base model, then the adapter again: the base
    model's output is its own (no adapter K/V reused), the adapter's second run hits its cache."""
    config = ModelConfig.load(base)
    write_peft(tmp_path / "a", config, seed=3)
    runner = ModelRunner.from_dir(base, 64, ops=NumpyOps())
    runner.serve_adapters(1, 8)
    runner.load_adapter(read_adapter("a", tmp_path / "a", config), 0)
    fresh = Harness(ModelRunner.from_dir(base, 64, ops=NumpyOps()), Tokenizer(base))
    plain = fresh.submit(PROMPT, max_tokens=8, ignore_eos=True)
    fresh.run()
    harness = Harness(runner, Tokenizer(base))
    use = AdapterUse(0, 1.0, 7)
    first = harness.submit(PROMPT, max_tokens=8, ignore_eos=True, adapter=use)
    harness.run()
    second = harness.submit(PROMPT, max_tokens=8, ignore_eos=True)
    harness.run()
    third = harness.submit(PROMPT, max_tokens=8, ignore_eos=True, adapter=use)
    harness.run()
    assert harness.tokens(second) == fresh.tokens(plain) != harness.tokens(first)
    assert harness.tokens(third) == harness.tokens(first)
    assert harness.final(second).usage.cached_tokens == 0
    assert harness.final(third).usage.cached_tokens == 16


def test_refuses_an_adapter_for_another_model(base, tmp_path):
    config = ModelConfig.load(base)
    write_peft(tmp_path / "a", config, seed=4)
    other = ModelConfig.load(make_tiny_model(tmp_path / "other", hidden=96, heads=4, kv_heads=2))
    with pytest.raises(Exception, match="an adapter for another model"):
        read_adapter("a", tmp_path / "a", other)
    (tmp_path / "dora").mkdir()
    shutil.copy(tmp_path / "a" / "adapter_model.safetensors", tmp_path / "dora")
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(Exception, match="plain LoRA adapters; this one uses use_dora"):
        read_adapter("d", tmp_path / "dora", config)


def test_server_serves_adapters_by_name(base, tmp_path):
    """vLLM's flags and llama-server's side by side: /v1/models lists the adapters, a request
    names one as its model (the official client), llama-server's lora field chooses by id,
    adapters load and unload at run time, and mistakes are one 400 each."""
    config = ModelConfig.load(base)
    tensors = write_peft(tmp_path / "sql", config, seed=5)
    write_peft(tmp_path / "chat", config, seed=6)
    write_gguf_adapter(tmp_path / "style.gguf", config, tensors, 8.0)
    write_peft(tmp_path / "late", config, seed=7)
    merged = merged_model(base, tmp_path / "merged", tensors, 2.0)
    server = LiveServer("--model", str(base), "--backend", "numpy", "--served-model-name", "base",
                        "--enable-lora", "--lora-modules", f"sql={tmp_path / 'sql'}",
                        json.dumps({"name": "chat", "path": str(tmp_path / "chat")}),
                        "--lora", str(tmp_path / "style.gguf"), "--lora-init-without-apply", "--max-loras", "4",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    reference = LiveServer("--model", str(merged), "--backend", "numpy", "--served-model-name", "base")
    try:
        client, merged_client = server.openai_client(), reference.openai_client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "sql", "chat", "style"}
        assert cards["sql"].parent == "base" and cards["sql"].root == str(tmp_path / "sql")

        def text(c, model, **extra):
            return c.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0,
                                        extra_body=extra).choices[0].text

        want = text(merged_client, "base")
        assert text(client, "sql") == want != text(client, "base")
        assert text(client, "style") == want  # the GGUF twin
        vectors = {m: client.embeddings.create(model=m, input="hello there").data[0].embedding for m in ("base", "sql")}
        assert vectors["base"] != vectors["sql"]
        assert merged_client.embeddings.create(model="base", input="hello there").data[0].embedding == \
            pytest.approx(vectors["sql"], abs=1e-5)
        ids = {a["path"]: a["id"] for a in httpx.get(server.url + "/lora-adapters").json()}
        assert text(client, "base", lora=[{"id": ids[str(tmp_path / "style.gguf")], "scale": 1.0}]) == want
        bad = httpx.post(server.url + "/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2,
                                                                 "lora": [{"id": 99, "scale": 1}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora"
        two = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]
        bad = httpx.post(server.url + "/v1/completions", json={"model": "base", "prompt": "hi", "lora": two})
        assert bad.status_code == 400 and "one LoRA adapter a request" in bad.json()["error"]["message"]

        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "late",
                                                                   "lora_path": str(tmp_path / "late")})
        assert r.status_code == 200, r.text
        assert "late" in {m.id for m in client.models.list().data}
        assert text(client, "late") != text(client, "base")
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        gone = httpx.post(server.url + "/v1/completions", json={"model": "late", "prompt": "hi"})
        assert gone.status_code == 404
        assert text(client, "sql") == want  # the others unharmed
    finally:
        server.stop()
        reference.stop()


def test_an_unloaded_adapters_slot_waits_for_its_requests(base, tmp_path):
    """Unloading takes the name away at once; the slot is loaded again only after the requests
    still running with it end, so they keep their adapter's weights to the last token."""
    from app.server.adapters import Adapters
    from model.errors import ModelError

    config = ModelConfig.load(base)
    for name in "abc":
        write_peft(tmp_path / name, config, seed=ord(name))
    runner = ModelRunner.from_dir(base, 64, ops=NumpyOps())
    runner.serve_adapters(1, 8)
    harness = Harness(runner, Tokenizer(base))
    adapters = Adapters(harness.engine, config, "base", runtime=True)
    first = adapters.load("a", str(tmp_path / "a"))
    alone = Harness(runner, Tokenizer(base))
    rid = alone.submit(PROMPT, max_tokens=6, ignore_eos=True, adapter=first.use)
    alone.run()
    running = harness.submit(PROMPT, max_tokens=6, ignore_eos=True, adapter=first.use)
    harness.tick()
    adapters.unload("a")
    assert adapters.use_for("a", None) is None
    with pytest.raises(ModelError, match="still in use"):
        adapters.load("b", str(tmp_path / "b"))
    harness.run()
    assert harness.tokens(running) == alone.tokens(rid)
    assert adapters.load("c", str(tmp_path / "c")).use.slot == first.use.slot
