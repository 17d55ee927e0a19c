"""A request as the engine sees it: what was asked, where it is, and what it has produced."""

import enum
import time
from dataclasses import dataclass, field

from model.sampling import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"  # a queue slot, nothing else
    PREFILLING = "prefilling"  # KV blocks for its prompt (or history), no token sent yet
    DECODING = "decoding"  # KV blocks, tokens sent
    PREEMPTED = "preempted"  # a host spill buffer, or only its token history
    FINISHED = "finished"  # leaves through the planner's retire(), which frees blocks; then its final frame


@dataclass(frozen=True)
class ThinkingBudget:
    """A reasoning model's thinking, cut at max_tokens: then its end tokens are forced.

    The thinking opens with the output when start_ids is empty (the chat template opened it),
    else only when the output begins with start_ids; it ends when end_ids are written, or
    close_ids within the budget: harmony's <|end|> closes GPT-OSS's analysis, after which the
    model may call a tool rather than write end_ids' final answer.
    """

    end_ids: tuple[int, ...]
    max_tokens: int
    start_ids: tuple[int, ...] = ()
    close_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: whatever fits the context; 0: read the prompt, generate nothing
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # suppresses the model's end-of-generation set only
    grammar: str | None = None  # llguidance grammar text (JSON or Lark) the output must follow
    thinking: ThinkingBudget | None = None
    embed: bool = False  # an embedding: the prompt's last hidden state, pooled, and no token
    # each prompt token's logprob (but the first's) with the top n at its position; None: not
    # asked. Such a request computes its whole prompt: no prefix-cache hit skips a position.
    prompt_logprobs: int | None = None
    adapter: object = None  # a LoRA adapter's model.lora.AdapterUse; None: the base model


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Frame:
    """What a request's channel carries: deltas, then exactly one final frame
    (finish_reason set)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # per token: (token_id, logprob, [(id, logprob), ...])
    prompt_logprobs: list | None = None  # per prompt token but the first: (token_id, logprob, rank, top); with the first frame
    finish_reason: str | None = None  # stop | length | cancelled | error
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    usage: Usage | None = None
    error: str | None = None
    embedding: object = None  # an embedding request's final frame: its unit vector (float32)


@dataclass
class ScheduleState:
    """Where a request is and what it holds: written by the planner alone (planner.py and the
    block tables it drives), read by the engine and the output processor."""

    seq: int = 0  # arrival order: newest is the first preemption victim
    state: State = State.WAITING
    block_table: list[int] = field(default_factory=list)  # its blocks from logical block dropped_blocks on
    dropped_blocks: int = 0  # leading blocks freed: wholly before every layer's sliding window
    num_computed: int = 0  # tokens whose K/V is in the cache
    state_slot: int | None = None  # a hybrid model's delta-net state, while it holds blocks (state_slots.py)
    num_offered: int = 0  # tokens whose full blocks were offered to the prefix cache
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    host_cached: int = 0  # of those, from its host tier (loaded into fresh blocks)
    host_loads: int = 0  # host-tier loads into its table not done yet: not planned until then
    host_epoch: int = 0  # bumped when a failed load gives its table up: its other loads are stale
    spilled: object = None  # host copy of the K/V while preempted by spill (the runner's; the engine drops it)
    spilled_state: object = None  # a hybrid's delta-net state, copied out with its K/V
    spill_blocks: int = 0  # how many blocks that copy holds
    immune_until: int = 0  # output length before which it is not preempted again
    scheduled_at: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass
class OutputState:
    """What a request's tokens have meant so far and what is not sent yet: written by the
    output processor alone (and its grammar mask thread, which reads the matcher)."""

    detok: object = None
    stops: object = None
    matcher: object = None  # the grammar's state after this request's tokens (app/engine/grammar.py)
    thought: bool = False  # its thinking section (params.thinking) has ended
    pending_text: str = ""  # settled text not yet sent
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    pending_prompt_logprobs: list = field(default_factory=list)
    embedding: object = None  # what an embedding request produced, for its final frame
    mirostat_mu: float | None = None  # mirostat's state after the tokens so far (None: none drawn yet)
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class Request:
    """What was asked and the tokens produced (output_ids: appended by the output processor
    only), with the planner's state and the output processor's, each written by its owner."""

    id: str
    prompt_ids: list[int]
    params: GenerationParams
    max_tokens: int  # resolved against the context
    emit: object  # callable(Frame); raises when the client can no longer take frames
    output_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    schedule: ScheduleState = field(default_factory=ScheduleState)
    output: OutputState = field(default_factory=OutputState)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def target(self) -> int:
        """Tokens whose K/V must be computed before the next sample: the whole prompt, or
        during decode (and a recompute) everything but the last sampled token."""
        return len(self.prompt_ids) if not self.output_ids else self.num_tokens - 1

    @property
    def constrained(self) -> bool:
        """A grammar or a thinking budget masks its rows; each mask depends on its last token."""
        return self.params.grammar is not None or self.params.thinking is not None

    @property
    def waits_for_last_token(self) -> bool:
        """Its next row cannot be planned while its last token is in flight: a mask, or a
        sampler that reads the output on the host (bad words, DRY, a penalty window), depends on it."""
        return self.constrained or self.params.sampling.reads_output

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids), self.schedule.cached_tokens)
