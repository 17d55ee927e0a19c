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
# llama-server's sampler chain: its names, each with its letter (its `samplers` as a string)
SAMPLER_STAGES = {"penalties": "e", "dry": "d", "top_n_sigma": "s", "top_k": "k", "typ_p": "y", "top_p": "p",
                  "min_p": "m", "xtc": "x", "temperature": "t"}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    top_n_sigma: float = -1.0  # top-nσ: logits within n standard deviations of the largest; <= 0: off
    typical_p: float = 1.0  # locally typical sampling's mass (Meister et al.); 1: off
    dynatemp_range: float = 0.0  # dynamic temperature: temperature +- this, by the row's entropy; 0: off
    dynatemp_exponent: float = 1.0
    xtc_probability: float = 0.0  # XTC: how often the top choices above the threshold are excluded; 0: off
    xtc_threshold: float = 0.1  # above 0.5: off (no two tokens can pass it), as in llama.cpp
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be drawn; None: any
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's, as token ids: a word's last one is banned after the rest
    repetition_penalty: float = 1.0  # over prompt and output, as in transformers
    presence_penalty: float = 0.0  # over output, as in OpenAI's API
    frequency_penalty: float = 0.0
    penalty_last_n: int = -1  # llama-server's: the penalties look at the last n tokens only; -1: all, 0: none
    dry_multiplier: float = 0.0  # DRY (p-e-w's, as llama.cpp's): a repeated sequence's next token penalised; 0: off
    dry_base: float = 1.75  # below 1: off, as in llama.cpp
    dry_allowed_length: int = 2  # repeats this long go unpenalised
    dry_penalty_last_n: int = -1  # the tokens DRY looks back over; -1: the whole context, 0: off
    dry_sequence_breakers: tuple[int, ...] = ()  # token ids a repeat does not extend across
    mirostat: int = 0  # 2: mirostat 2 (llama.cpp's mirostat_v2) in place of the truncating filters; 0: off
    mirostat_tau: float = 5.0  # the surprise (bits) it aims at
    mirostat_eta: float = 0.1  # how fast mu follows the error
    mirostat_mu: float | None = None  # the request's mu before this draw (the engine keeps it); None: 2 tau
    logit_bias: dict[int, float] = field(default_factory=dict)
    # llama-server's samplers: the chain's stages (SAMPLER_STAGES) in its order, each applied only
    # if named (model/ops/numpy_chain.py); None: Spool's own order (numpy_sampling.pick)
    samplers: tuple[str, ...] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's plus the top n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0) and self.penalty_last_n != 0

    @property
    def reads_output(self) -> bool:
        """The draw depends on which tokens came last (not just on counts): bad words, a penalty
        window, DRY, mirostat (its mu follows the last draw). Such a row needs its last token on the host before it samples."""
        return bool(self.bad_words) or (self.penalized and self.penalty_last_n > 0) or self.dry or self.mirostat == 2

    @property
    def extended(self) -> bool:
        """Uses a sampler beyond the kernels' (temperature, top-k, top-p, min-p, top-nσ,
        penalties, bias): the row is drawn by the NumPy reference (model/ops/numpy_samplers.py)."""
        return (self.typical_p < 1.0 or self.dynatemp_range > 0 or self.excludes_top_choices
                or self.allowed_token_ids is not None or self.reads_output or self.samplers is not None)

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_base >= 1 and self.dry_penalty_last_n != 0

    @property
    def excludes_top_choices(self) -> bool:
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message fit for an API client."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "top_n_sigma", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "typical_p", "dynatemp_range", "dynatemp_exponent",
                     "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "mirostat_tau",
                     "mirostat_eta"):
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
        validate_extended(self, vocab_size)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")


def validate_extended(p: SamplingParams, vocab_size: int) -> None:
    """The ranges of the samplers beyond OpenAI's and vLLM's first ones, as llama.cpp reads them."""
    if not 0 < p.typical_p <= 1:
        raise ValueError(f"typical_p must be in (0, 1], got {p.typical_p}")
    if p.dynatemp_range < 0:
        raise ValueError(f"dynatemp_range must be >= 0, got {p.dynatemp_range}")
    if p.dynatemp_exponent < 0:
        raise ValueError(f"dynatemp_exponent must be >= 0, got {p.dynatemp_exponent}")
    if not 0 <= p.xtc_probability <= 1:
        raise ValueError(f"xtc_probability must be in [0, 1], got {p.xtc_probability}")
    if not 0 <= p.xtc_threshold <= 1:
        raise ValueError(f"xtc_threshold must be in [0, 1] (above 0.5: off), got {p.xtc_threshold}")
    if not isinstance(p.penalty_last_n, int) or p.penalty_last_n < -1:
        raise ValueError(f"penalty_last_n (repeat_last_n) must be -1 (all), 0 (off) or a positive int, got {p.penalty_last_n!r}")
    if p.dry_multiplier < 0:
        raise ValueError(f"dry_multiplier must be >= 0, got {p.dry_multiplier}")
    if not isinstance(p.dry_allowed_length, int) or p.dry_allowed_length < 0:
        raise ValueError(f"dry_allowed_length must be a whole number >= 0, got {p.dry_allowed_length!r}")
    if not isinstance(p.dry_penalty_last_n, int) or p.dry_penalty_last_n < -1:
        raise ValueError(f"dry_penalty_last_n must be -1 (all), 0 (off) or a positive int, got {p.dry_penalty_last_n!r}")
    unknown = [s for s in p.samplers or () if s not in SAMPLER_STAGES]
    if unknown:
        raise ValueError(f"samplers has {unknown[0]!r}; the stages are {', '.join(SAMPLER_STAGES)} (or their letters"
                         f" {''.join(SAMPLER_STAGES.values())} as one string)")
    if p.mirostat not in (0, 2):
        raise ValueError(f"mirostat must be 0 (off) or 2 (mirostat 2); mirostat 1 is not supported, got {p.mirostat!r}")
    if p.mirostat_tau < 0 or p.mirostat_eta < 0:
        raise ValueError(f"mirostat_tau and mirostat_eta must be >= 0, got {p.mirostat_tau}, {p.mirostat_eta}")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise ValueError("allowed_token_ids is empty: no token could be drawn")
        outside = [t for t in p.allowed_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"allowed_token_ids has {outside[0]!r}, outside the vocabulary [0, {vocab_size})")
    for word in p.bad_words:
        if not word or not all(isinstance(t, int) and 0 <= t < vocab_size for t in word):
            raise ValueError(f"bad_words has a word of token ids {word!r} outside the vocabulary [0, {vocab_size})")


def _mix64(z: int) -> int:
    """splitmix64's finaliser: cheap, well mixed, and easy to write the same way in CUDA."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


XTC_STREAM = 1  # seeded_uniform's stream for XTC's coin, apart from the draw's (0)


def seeded_uniform(seed: int, index: int, stream: int = 0) -> float:
    """A uniform in [0, 1) keyed by (seed, token index) alone, so a seeded request draws the
    same numbers whatever else shares its batch; stream: another sequence for the same key
    (a sampler's own coin), independent of the draw's."""
    key = _mix64(seed & _M64)
    if stream:
        key = _mix64(key + stream)
    return (_mix64(key ^ (index & _M64)) >> 11) * (1.0 / (1 << 53))


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """A grammar's mask (int32 words of bits: token t is bit t % 32 of word t // 32, as
    llguidance writes them) as one bool per token id; ids past the mask's end are not allowed
    (a padded vocabulary's rows that no token names)."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return bits if len(bits) == vocab else np.pad(bits, (0, vocab - len(bits)))
