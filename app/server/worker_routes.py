"""What request routers ask of a worker besides the OpenAI routes, in the shapes their sources
read: vLLM's router (vllm-router) and SGLang's (sglang-router) both put a fleet of Spool
replicas behind one address, with prefix-aware routing, health checks and retries.

    GET  /server_info, /get_server_info   the served model, its path, and the limits
    GET  /model_info, /get_model_info     model and tokenizer paths, type, architectures
    GET  /get_load                        requests and tokens held, per data-parallel rank (one)
    POST /flush_cache                     drop the prefix cache's unreferenced blocks
    POST /v1/chat/completions/render      a request's prompt token ids, as the route would build
    POST /v1/completions/render           them (cache-aware routing hashes these)
"""

from app import version
from app.server.errors import APIError
from app.server.prompts import chat_tokens, completion_prompts
from app.server.schemas import ChatCompletionRequest, CompletionRequest
from app.server.state import ServerState
from app.server.workers import json_reply, off_loop, parse


async def server_info(state: ServerState):
    engine = state.engine
    pool, config = engine.pool, engine.config
    return {
        "model_id": state.model_name,
        "served_model_name": state.model_name,
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "version": version(),
        "backend": state.backend,
        "dp_size": 1,
        "max_model_len": state.max_model_len,
        "max_total_tokens": pool.num_blocks * pool.block_size,  # what the KV cache holds
        "max_prefill_tokens": config.max_batched_tokens,
        "max_running_requests": config.max_seqs,
        "page_size": pool.block_size,
        # vLLM's /server_info nests its config; vllm-router reads the block size from it
        "vllm_config": {
            "model_config": {"model": state.model_path, "served_model_name": state.model_name,
                             "max_model_len": state.max_model_len},
            "cache_config": {"block_size": pool.block_size, "enable_prefix_caching": pool.prefix_caching,
                             "cache_dtype": state.kv_cache_dtype},
        },
    }


async def model_info(state: ServerState):
    return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
            "model_type": state.model_type, "architectures": state.architectures}


async def get_load(state: ServerState):
    status = state.engine.status()
    pool = state.engine.pool
    waiting = status["num_requests_waiting"]
    return [{"dp_rank": 0, "num_reqs": status["num_requests_running"] + waiting, "num_waiting_reqs": waiting,
             "num_tokens": status["kv_blocks_used"] * pool.block_size}]


async def flush_cache(state: ServerState):
    return {"flushed_blocks": state.engine.pool.flush()}


async def render_chat(state: ServerState):
    req = await parse(state, ChatCompletionRequest)
    state.check_model(req.model)
    return await rendered(state, await off_loop(state, chat_tokens, state, req))


async def render_completion(state: ServerState):
    req = await parse(state, CompletionRequest)
    state.check_model(req.model)
    prompts = await off_loop(state, completion_prompts, req, state.tokenizer)
    if len(prompts) != 1:
        raise APIError(400, "render takes one prompt", param="prompt")
    return await rendered(state, prompts[0])


async def rendered(state: ServerState, token_ids: list[int]):
    """vLLM's render shape: the prompt's ids, and no multimodal features."""
    return await json_reply(state, {"model": state.model_name, "token_ids": token_ids, "features": None})


ROUTES = [
    ("GET", "/server_info", server_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/model_info", model_info),
    ("GET", "/get_model_info", model_info),
    ("GET", "/get_load", get_load),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/v1/chat/completions/render", render_chat),
    ("POST", "/v1/completions/render", render_completion),
]
