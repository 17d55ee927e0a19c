"""The LoRA adapters' routes: vLLM's run-time loading (/v1/load_lora_adapter and
/v1/unload_lora_adapter, behind VLLM_ALLOW_RUNTIME_LORA_UPDATING) and llama-server's
/lora-adapters (the list, and the scale each applies to every request)."""

from pydantic import BaseModel, ConfigDict

from app.server.errors import APIError
from app.server.openapi import Documented
from app.server.state import ServerState
from app.server.workers import off_loop, parse
from model.errors import ModelError


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def served(state: ServerState, runtime: bool = False):
    if state.adapters is None:
        raise APIError(404 if not runtime else 400, "this server serves no LoRA adapters (start it with"
                       " --enable-lora, --lora-modules or --lora)", code="lora_disabled")
    if runtime and not state.adapters.runtime:
        raise APIError(400, "loading adapters at run time is off: start the server with"
                            " VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in its environment", code="lora_disabled")
    return state.adapters


async def load_lora_adapter(state: ServerState):
    req = await parse(state, LoadLoraRequest)
    adapters = served(state, runtime=True)
    try:
        await off_loop(state, adapters.load, req.lora_name, req.lora_path)
    except ModelError as e:
        raise APIError(400, str(e), param="lora_path") from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully.", 200, {"Content-Type": "text/plain"}


async def unload_lora_adapter(state: ServerState):
    req = await parse(state, UnloadLoraRequest)
    served(state, runtime=True).unload(req.lora_name)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully.", 200, {"Content-Type": "text/plain"}


async def lora_adapters(state: ServerState):
    return served(state).listed()


async def set_lora_scales(state: ServerState):
    from quart import request

    adapters = served(state)
    adapters.set_scales(await request.get_json(force=True, silent=True))
    return adapters.listed()


ROUTES = [
    ("POST", "/v1/load_lora_adapter", load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", unload_lora_adapter),
    ("GET", "/lora-adapters", lora_adapters),
    ("POST", "/lora-adapters", set_lora_scales),
]
DOCUMENTED = [
    Documented("/v1/load_lora_adapter", "post", "Load a LoRA adapter by name and path (vLLM's; at run time only"
                                                " with VLLM_ALLOW_RUNTIME_LORA_UPDATING)", LoadLoraRequest),
    Documented("/v1/unload_lora_adapter", "post", "Unload a LoRA adapter by name (vLLM's)", UnloadLoraRequest),
    Documented("/lora-adapters", "get", "The LoRA adapters, with the scale each applies to every request"
                                        " (llama-server's)"),
    Documented("/lora-adapters", "post", "Set the scale each adapter applies to every request (llama-server's)"),
]
