"""`spool generate`: one chat turn through the engine, streamed to the terminal."""

import sys

import trio

from app.engine import Engine, EngineConfig, EngineError, GenerationParams
from app.flags import fetch_model
from model.backend import resolve
from model.kv_cache import DEFAULT_BLOCK_SIZE
from model.runner import ModelRunner
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer, chat_template_text


def run_generate(args) -> int:
    """Bad flags, a --chat-template that refuses the message and a model the backend cannot run
    raise ValueError, which the command prints as one line."""
    backend = resolve(args.backend, args.dtype)
    model_dir = fetch_model(args)
    tokenizer = Tokenizer(args.tokenizer or model_dir, chat_template_text(args.chat_template))
    prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    model = backend.load(model_dir)
    context = min(len(prompt) + max(args.max_tokens, 1), model.config.max_position_embeddings)
    runner = ModelRunner(model.config, model, num_blocks=-(-context // DEFAULT_BLOCK_SIZE))
    engine = Engine(runner, tokenizer, EngineConfig(max_model_len=model.config.max_position_embeddings,
                                                    decode_log_interval=0))
    params = GenerationParams(SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
                              max_tokens=args.max_tokens)

    async def main() -> int:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                _, frames = engine.submit(prompt, params)
            except EngineError as e:
                print(f"error: {e}", file=sys.stderr)
                nursery.cancel_scope.cancel()
                return 2
            async for frame in frames:
                sys.stdout.write(frame.text)
                sys.stdout.flush()
                if frame.finish_reason is not None:
                    break
            sys.stdout.write("\n")
            if frame.error:
                print(f"error: {frame.error}", file=sys.stderr)
            nursery.cancel_scope.cancel()
            return 0 if frame.finish_reason in ("stop", "length") else 1

    return trio.run(main)
