"""Request and reply bodies of OpenAI's embeddings API, as pydantic models."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.server.limits import Limits
from app.server.request_limits import at_most, count_prompts


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def check_limits(self, limits: Limits, max_queue: int) -> None:
        inputs = count_prompts(self.input)
        at_most("input", "inputs", inputs, limits.max_embedding_inputs, "--max-embedding-inputs")
        at_most("input", "inputs", inputs, max_queue, "--max-queue, the most requests the queue holds")



class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
