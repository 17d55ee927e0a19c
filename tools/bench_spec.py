"""Speculative decoding at batch 1: decode tok/s with and without it, on a copy-heavy task
(rewrite a given text, edit given code) and on free writing, through the engine (no HTTP).

    python tools/bench_spec.py [--model DIR|FILE.gguf|Org/Name] [--speculative-config JSON]
        [--max-tokens 200] [--repeats 2]
    python tools/bench_spec.py --model qwen35-2b.gguf --speculative-config '{"method": "mtp"}'

Each prompt runs alone, greedy, once to warm up and then --repeats times with speculation off
and on, alternating; the table gives the median decode rate (output tokens after the first,
over the time after the first), the share of guesses kept, and whether the two runs wrote the
same tokens (they must: greedy rows are exact).

--oracle-acceptance P (method "mtp"): a random-weight model's MTP layer guesses nothing the
model keeps, so its gain cannot be read off it. The layer still runs in full, its LM head
included (the cost), but each guess it made is then replaced by the token the plain run wrote
there, or by another token, kept with probability P: the gain at that acceptance, every cost
real. A model with trained weights needs no oracle.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model  # noqa: E402, F401  (first: it sets the thread pools' environment before NumPy loads)
import numpy as np  # noqa: E402
import trio  # noqa: E402

from app.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from app.engine.speculation import SpeculativeConfig  # noqa: E402
from app.flags import attach_proposer, extra_kv_layers  # noqa: E402
from model.backend import resolve  # noqa: E402
from model.default import resolve_model  # noqa: E402
from model.runner import ModelRunner  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402

TEXT = ("The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
        "keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the lens. "
        "Ships passing in the dark saw the beam sweep across the water and knew where the rocks were. "
        "When the keeper grew old, the town installed an electric lamp, and the stairs were climbed only "
        "once a month, to clean the glass and check the bulbs.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    return total + total * tax_rate
'''
TASKS = {
    "rewrite (copy-heavy)": f"Rewrite the following text, word for word, but in the past perfect tense:\n\n{TEXT}",
    "code edit (copy-heavy)": f"Rename the variable `total` to `subtotal` in this function and return the whole"
                              f" function:\n\n{CODE}",
    "free writing": "Write a short story about a cat who learns to play the piano.",
}


async def generate(engine, prompt, max_tokens):
    """(output ids, seconds from the first token to the last)."""
    params = GenerationParams(SamplingParams(temperature=0.0), max_tokens=max_tokens)
    _, frames = engine.submit(prompt, params)
    ids, first = [], None
    async for frame in frames:
        if frame.token_ids and first is None:
            first = time.perf_counter()
        ids += frame.token_ids
        if frame.finish_reason is not None:
            break
    return ids, time.perf_counter() - first


def oracle(mtp, tokens: list[int], acceptance: float, vocab: int) -> None:
    """After each of the MTP layer's passes, its guesses for the row starting at position `at`
    become tokens[at + 1 + j] (the plain run's) with probability acceptance, else another."""
    follow = mtp.follow

    def replaced(rows, hidden, ids):
        follow(rows, hidden, ids)
        for at, made in mtp.guesses.values():
            for j in range(len(made)):
                right = tokens[at + 1 + j] if at + 1 + j < len(tokens) else made[j]
                kept = np.random.default_rng([at, j]).random() < acceptance
                made[j] = right if kept else (right + 1) % vocab
    mtp.follow = replaced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--oracle-acceptance", type=float, default=None)
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    backend = resolve("cpu", "auto")
    llama = backend.load(model_dir)
    config = SpeculativeConfig.parse(args.speculative_config)
    print(f"# model {model_dir.name}, {backend.name} ({backend.dtype}), batch 1, greedy, max_tokens {args.max_tokens};"
          f" speculation {config}")
    print("| task | tokens | plain tok/s | speculative tok/s | speed-up | guesses kept | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | :---: |")

    async def run_task(prompt):
        rates = {False: [], True: []}
        outputs, kept = {}, None
        for spec in (False, True):
            runner = ModelRunner(llama.config, llama, num_blocks=256, seed=0,
                                 extra_layers=extra_kv_layers(config) if spec else 0)
            if spec:
                attach_proposer(runner, config, backend, model_dir, tokenizer)
                if args.oracle_acceptance is not None:
                    oracle(runner.draft, [*prompt, *outputs[False]], args.oracle_acceptance, llama.config.vocab_size)
            engine = Engine(runner, tokenizer, EngineConfig(max_model_len=4096, decode_log_interval=0,
                                                            speculative=config if spec else None))
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                await generate(engine, prompt, 8)  # warm
                for _ in range(args.repeats):
                    ids, seconds = await generate(engine, prompt, args.max_tokens)
                    rates[spec].append((len(ids) - 1) / seconds)
                    outputs[spec] = ids
                if spec:
                    s = engine.planner.speculation.stats
                    kept = s.accepted_tokens / max(s.draft_tokens, 1)
                nursery.cancel_scope.cancel()
        return rates, outputs, kept

    for name, text in TASKS.items():
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        rates, outputs, kept = trio.run(run_task, prompt)
        plain, spec = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {name} | {len(outputs[True])} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {kept:.0%} |"
              f" {'yes' if outputs[True] == outputs[False] else 'NO'} |")


if __name__ == "__main__":
    main()
