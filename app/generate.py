"""`python -m app generate`: one chat turn through the runner, streamed to the terminal.

A single request needs no scheduler: prefill the prompt in chunks, then decode one token per
step until an end-of-generation token or --max-tokens.
"""

import sys

from model.default import resolve_model
from model.kv_cache import DEFAULT_BLOCK_SIZE
from model.runner import ModelRunner, Row, StepPlan, load_model
from model.sampling import SamplingParams
from model.tokenizer import IncrementalDetokenizer, Tokenizer

PREFILL_CHUNK = 512


def run_generate(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    try:
        params.validate(tokenizer.vocab_size)
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    model = load_model(model_dir)
    context = min(len(prompt) + args.max_tokens, model.config.max_position_embeddings)
    if len(prompt) >= context:
        print(f"error: the prompt has {len(prompt)} tokens, the model's context is"
              f" {model.config.max_position_embeddings}; shorten it", file=sys.stderr)
        return 2
    runner = ModelRunner(model.config, model, num_blocks=-(-context // DEFAULT_BLOCK_SIZE))
    table = list(range(runner.num_blocks))

    detok = IncrementalDetokenizer(tokenizer, prompt)
    output: list[int] = []
    start = 0
    while start < len(prompt):  # chunked prefill; only the last chunk samples
        chunk = prompt[start:start + PREFILL_CHUNK]
        last = start + len(chunk) == len(prompt)
        row = Row("cli", chunk, start, table, sample=last, params=params, prompt_ids=prompt, output_ids=output)
        sampled = runner.step(StepPlan([row]))
        start += len(chunk)
    while True:
        token = sampled[0].token_id
        if token in tokenizer.eos_token_ids:
            break
        output.append(token)
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
        if len(output) >= args.max_tokens or len(prompt) + len(output) >= context:
            break
        row = Row("cli", [token], len(prompt) + len(output) - 1, table, sample=True,
                  params=params, prompt_ids=prompt, output_ids=output)
        sampled = runner.step(StepPlan([row]))
    sys.stdout.write(detok.flush() + "\n")
    return 0
