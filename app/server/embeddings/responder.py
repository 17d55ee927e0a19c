"""OpenAI's embeddings reply: one vector per input, in input order, as floats or as base64 of
little-endian float32 (what the openai client asks for by default and decodes itself);
`dimensions` keeps the first that many and makes them unit length again (Matryoshka-trained
models such as Qwen3-Embedding are meant to be cut so)."""

import base64

import numpy as np

from app.server.embeddings.schemas import Embedding, EmbeddingResponse, EmbeddingUsage
from app.server.errors import APIError


def check_dimensions(req, hidden: int) -> None:
    if req.dimensions is not None and req.dimensions > hidden:
        raise APIError(400, f"dimensions is {req.dimensions}, but this model's embeddings have {hidden}",
                       param="dimensions")


def reply(gen, req, model_name: str) -> dict:
    data, prompt_tokens = [], 0
    for choice in sorted(gen.choices.values(), key=lambda c: c.index):
        vector = np.asarray(choice.embedding, dtype=np.float32)
        if req.dimensions is not None:
            vector = vector[:req.dimensions] / max(float(np.linalg.norm(vector[:req.dimensions])), 1e-12)
        vector = vector.astype("<f4")
        encoded = base64.b64encode(vector.tobytes()).decode() if req.encoding_format == "base64" else vector.tolist()
        data.append(Embedding(index=choice.index, embedding=encoded))
        prompt_tokens += choice.prompt_tokens
    return EmbeddingResponse(data=data, model=model_name,
                             usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)).model_dump()
