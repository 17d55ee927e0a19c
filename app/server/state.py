"""What every route reads: the engine, the tokenizer, the served model and the limits, as one
typed value that create_app binds to each route.

serve() makes it before the model loads (engine None: every route but /health and the chat
page answers 503) and fills in the rest once the engine runs.
"""

from dataclasses import dataclass, field

import trio

from app.server.errors import APIError
from app.server.limits import Limits
from app.server.http.listener import ConnectionStats
from app.server.origins import OriginPolicy
from app.server.tools import HERMES


@dataclass
class ServerState:
    model_name: str  # the name replies carry: --served-model-name's first
    aliases: list = field(default_factory=list)  # its other names, which requests may use too
    engine: object = None  # None while the model loads
    tokenizer: object = None
    tool_format: object = HERMES  # how the model writes tool calls (app/server/tools), once loaded
    reasoning: str | None = None  # how it writes its thinking (app/server/reasoning.py), once loaded
    max_model_len: int = 0
    api_keys: tuple[str, ...] = ()  # --api-key's; none: every route is open
    origins: OriginPolicy = field(default_factory=OriginPolicy)  # which web pages may call it
    ui: bool = True  # serve the chat page at /
    backend: str = ""  # "cpu (q8_0)", once loaded
    kv_cache_dtype: str = ""  # "float16", "q8_0" ..., once loaded
    model_path: str = ""  # the Hugging Face directory served, once loaded
    model_type: str = ""
    architectures: list = field(default_factory=list)
    request_timeout: float | None = None  # seconds; None: no limit
    sampling_defaults: dict = field(default_factory=dict)  # the generation config's (generation_config.py)
    limits: Limits = field(default_factory=Limits)
    connections: ConnectionStats = field(default_factory=ConnectionStats)
    responses: object = None  # the Responses API's store (app/server/responses/store.py), once serve() makes it
    adapters: object = None  # the LoRA adapters served (app/server/adapters.Adapters), where any may be
    workers: trio.CapacityLimiter = field(init=False)  # the threads of app/server/workers.py, --request-threads

    def __post_init__(self):
        self.workers = trio.CapacityLimiter(self.limits.request_threads)

    @property
    def max_queue(self) -> int:
        return self.engine.config.max_queue

    @property
    def model_names(self) -> list[str]:
        """The base model's names, then the LoRA adapters'."""
        return [self.model_name, *self.aliases, *(self.adapters.served if self.adapters is not None else ())]

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", *self.model_names):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
