"""Validation at the door: refuse, with a client-facing EngineError, what could never run.
A request that passes fits the context and the KV cache, so the planner never refuses one."""

from app.engine.block_pool import BlockPool
from app.engine.errors import EngineError
from app.engine.grammar import Grammars
from app.engine.request import GenerationParams
from model.errors import is_failure, one_line


def validate(prompt_ids: list[int], params: GenerationParams, *, max_model_len: int, pool: BlockPool,
             vocab_size: int, grammars: Grammars) -> int:
    """Raises EngineError; returns max_tokens resolved against the context."""
    limit, vocab = max_model_len, vocab_size
    if not prompt_ids:
        raise EngineError("the prompt is empty", "prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    if len(prompt_ids) >= limit:
        raise EngineError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit}", "prompt")
    needed = pool.blocks_for(len(prompt_ids) + 1)
    if needed > pool.num_blocks:
        raise EngineError(f"the prompt needs {needed} KV blocks and the cache has {pool.num_blocks};"
                          f" start the server with a larger KV cache", "prompt")
    room = limit - len(prompt_ids)
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens < 0:
        raise EngineError(f"max_tokens must be at least 0, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        raise EngineError(f"max_tokens is {max_tokens}, but the context of {limit} leaves {room}"
                          f" after the {len(prompt_ids)}-token prompt", "max_tokens")
    if not 0 <= params.min_tokens <= max_tokens:
        raise EngineError(f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {params.min_tokens}",
                          "min_tokens")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise EngineError(f"stop_token_ids has {bad}, outside the vocabulary [0, {vocab})", "stop_token_ids")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= 20:
        raise EngineError(f"prompt_logprobs must be in [0, 20], got {params.prompt_logprobs}", "prompt_logprobs")
    try:
        params.sampling.validate(vocab)
    except ValueError as e:
        raise EngineError(str(e), str(e).split(" ", 1)[0]) from None
    if params.grammar is not None:
        try:
            grammars.pristine(params.grammar)
        except BaseException as e:  # llguidance's own refusal, or its panic (a BaseException)
            if not is_failure(e):
                raise
            raise EngineError(f"the output format cannot be compiled: {one_line(e)}", "grammar") from None
    return max_tokens
