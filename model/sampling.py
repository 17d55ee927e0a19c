"""What a request asks of the sampler, checked once, before it reaches the engine.

The sampling math itself lives in the ops backends (NumPy, numba, CUDA kernels on the GPU); this
module only holds the parameters and the counter-based random numbers both sides share.
"""

import math
from dataclasses import dataclass, field

import numpy as np

_M64 = (1 << 64) - 1
INT32_MAX = 2**31 - 1  # the widest top_k a sampler holds (int32 on the device)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    top_n_sigma: float = -1.0  # top-nσ: logits within n standard deviations of the largest; <= 0: off
    repetition_penalty: float = 1.0  # over prompt and output, as in transformers
    presence_penalty: float = 0.0  # over output, as in OpenAI's API
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's plus the top n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message fit for an API client."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "top_n_sigma", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive int32, got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias has token id {token!r}, outside the vocabulary [0, {vocab_size})")
            finite(f"logit_bias[{token}]", bias)
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")


def _mix64(z: int) -> int:
    """splitmix64's finaliser: cheap, well mixed, and easy to write the same way in CUDA."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) keyed by (seed, token index) alone, so a seeded request draws the
    same numbers whatever else shares its batch."""
    return (_mix64(_mix64(seed & _M64) ^ (index & _M64)) >> 11) * (1.0 / (1 << 53))


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A grammar's mask (int32 words of bits: token t is bit t % 32 of word t // 32, as
    llguidance writes them) as one bool per token id; ids past the mask's end are not allowed
    (a padded vocabulary's rows that no token names)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return bits if len(bits) == vocab else np.pad(bits, (0, vocab - len(bits)))
