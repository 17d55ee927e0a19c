"""POST /v1/embeddings: each input's last hidden state, unit length, batched by the engine with
everything else."""

from app.server.embeddings.responder import check_dimensions, reply
from app.server.embeddings.schemas import EmbeddingRequest, EmbeddingResponse
from app.server.generation import Generation
from app.server.openapi import Documented
from app.server.prompts import check_embeddings
from app.server.state import ServerState
from app.server.workers import off_loop, parse


async def create_embeddings(state: ServerState):
    req = await parse(state, EmbeddingRequest)
    state.check_model(req.model)
    check_dimensions(req, state.engine.runner.config.hidden_size)
    submissions = await off_loop(state, check_embeddings, state, req)
    gen = Generation(state.engine, submissions, "embd", state.request_timeout)
    await gen.collect()
    return reply(gen, req, state.model_name)


ROUTES = [("POST", "/v1/embeddings", create_embeddings)]
DOCUMENTED = [
    Documented("/v1/embeddings", "post", "Each input's last hidden state as a unit vector (float or base64)",
               EmbeddingRequest, EmbeddingResponse),
]
