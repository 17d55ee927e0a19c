"""The reference logits, greedy tokens and pooled embeddings of every family in
tools/family_models.py, computed
once by transformers and written to tests/data/families/<name>.npz, which tests/test_families.py
holds every backend against.

torch and transformers are not Spool's dependencies; run this in an environment that has them
(made with: python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers==5.23.0
safetensors numpy), from the repository's root:

    /tmp/hf/bin/python tools/family_fixtures.py [name ...]

Each fixture records the digest of the tensors it was made from and the config it used; the test
refuses a fixture whose maker has changed since, so regenerate after editing FAMILIES.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_models import FAMILIES, make_family  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "families"
PROMPT, GREEDY = 18, 12  # within the shortest served context (32) together
EMBED_LENGTHS = (5, 11, 18)  # prefixes of the prompt embedded


def prompt_ids(name: str, vocab: int) -> np.ndarray:
    """The prompt: past the trained context where the fixture serves a longer one (LongRoPE's
    long factors apply only there)."""
    _, context = FAMILIES[name]
    length = 40 if name.endswith("-long") else PROMPT
    assert length + GREEDY <= context
    return np.random.default_rng(7).integers(3, vocab, length)


def reference(name: str) -> dict:
    import torch
    import transformers

    config, context = FAMILIES[name]
    with tempfile.TemporaryDirectory() as tmp:
        path, digest = make_family(name, Path(tmp) / name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompt_ids(name, config["vocab_size"])
    with torch.inference_mode():
        logits = model(torch.tensor(ids)[None]).logits[0].numpy()
        tokens = list(ids)
        for _ in range(GREEDY):  # the whole sequence again each step: no cache to trust
            tokens.append(int(model(torch.tensor(tokens)[None]).logits[0, -1].argmax()))
        # embeddings: the last token's final hidden state (after the final norm), unit length
        pooled = []
        for n in EMBED_LENGTHS:
            last = base(torch.tensor(ids[:n])[None]).last_hidden_state[0, -1].numpy().astype(np.float64)
            pooled.append(last / np.linalg.norm(last))
    return {"ids": ids, "logits": logits.astype(np.float32), "greedy": np.array(tokens[len(ids):]),
            "pooled": np.array(pooled, dtype=np.float32),
            "digest": digest, "config": json.dumps(config, sort_keys=True), "context": context,
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}"}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or sorted(FAMILIES):
        fixture = reference(name)
        np.savez_compressed(OUT / f"{name}.npz", **fixture)
        print(f"{name}: {fixture['logits'].shape} logits, greedy {fixture['greedy'].tolist()}")


if __name__ == "__main__":
    main()
