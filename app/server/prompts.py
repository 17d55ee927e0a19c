"""From an API request to what the engine takes: prompt token ids, and GenerationParams for
each of its choices; start_generation checks them in a worker thread (app/server/workers.py)
and puts them together as one Generation on the event loop.

The HTTP routes, the render routes and the WebSocket all build prompts here, so a router that
hashes a rendered prompt sees the ids the generation runs on.
"""

from dataclasses import dataclass, field

from app.engine import GenerationParams
from app.server.chat_text import Reading
from app.server.errors import APIError
from app.server.formats import grammar
from app.server.generation import Generation, Submission, check_choices
from app.server.harmony import after_analysis
from app.server import xtml
from app.server.reasoning import HARMONY, THINK, XTML, after_thinking, budget, opens_thinking, whole_reader
from app.server.schemas import ChatCompletionRequest
from app.server.state import ServerState
from app.server.tools import ToolFormat, ToolUse, prompt_messages
from app.server.workers import off_loop
from model.sampling import SAMPLER_STAGES, SamplingParams
from model.tokenizer import THINK_TAGS, ChatTemplateError


def sampling_params(req, logprobs: int | None, index: int, defaults: dict | None = None,
                    tokenizer=None) -> SamplingParams:
    """The request's sampling fields; those it leaves out are the model's generation config's
    (defaults: app/server/generation_config.py), else OpenAI's. The engine validates them.
    tokenizer: for bad_words, which are text."""
    given = defaults or {}

    def field(name, default):
        value = getattr(req, name)
        return given.get(name, default) if value is None else value

    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    return SamplingParams(
        temperature=field("temperature", 1.0),
        top_p=field("top_p", 1.0),
        top_k=field("top_k", 0),
        min_p=field("min_p", 0.0),
        top_n_sigma=field("top_n_sigma", -1.0),
        typical_p=field("typical_p", 1.0),
        dynatemp_range=field("dynatemp_range", 0.0),
        dynatemp_exponent=field("dynatemp_exponent", 1.0),
        xtc_probability=field("xtc_probability", 0.0),
        xtc_threshold=field("xtc_threshold", 0.1),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        bad_words=bad_word_ids(tokenizer, req.bad_words or ()),
        repetition_penalty=field("repetition_penalty", 1.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        penalty_last_n=req.penalty_last_n if req.penalty_last_n is not None else field("repeat_last_n", -1),
        dry_multiplier=field("dry_multiplier", 0.0),
        dry_base=field("dry_base", 1.75),
        dry_allowed_length=field("dry_allowed_length", 2),
        dry_penalty_last_n=field("dry_penalty_last_n", -1),
        dry_sequence_breakers=breaker_ids(tokenizer, req.dry_sequence_breakers) if req.dry_multiplier else (),
        mirostat=field("mirostat", 0),
        mirostat_tau=field("mirostat_tau", 5.0),
        mirostat_eta=field("mirostat_eta", 0.1),
        logit_bias=bias,
        samplers=sampler_chain(req.samplers),
        seed=None if req.seed is None else req.seed + index,
        logprobs=logprobs,
    )


def bad_word_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token ids: each word as it starts a text, and, where that tokenizes
    differently into as many tokens, after a space (a word in the middle of a text)."""
    ids: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise APIError(400, f"bad_words has an empty word: {word!r}", param="bad_words")
        ids.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            ids.append(spaced)
    return tuple(ids)


DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default dry_sequence_breakers


def sampler_chain(samplers: list[str] | str | None) -> tuple[str, ...] | None:
    """llama-server's samplers as stage names: a list of names, or a string of their letters
    ("kypmt"); SamplingParams.validate names what is unknown."""
    if samplers is None:
        return None
    if isinstance(samplers, list):
        return tuple(samplers)
    names = {letter: name for name, letter in SAMPLER_STAGES.items()}
    return tuple(names.get(letter, letter) for letter in samplers)


def breaker_ids(tokenizer, breakers: list[str] | None) -> tuple[int, ...]:
    """DRY's sequence breakers as token ids, as p-e-w's sampler takes them: each the last token
    of the text after a letter (llama.cpp also matches a breaker of several tokens whole)."""
    return tuple(sorted({tokenizer.encode("a" + b, add_special_tokens=False)[-1]
                         for b in (DRY_BREAKERS if breakers is None else breakers) if b}))


def generation_params(req, index: int, grammar_text: str | None = None, thinking=None,
                      defaults: dict | None = None, tokenizer=None, adapter=None) -> GenerationParams:
    prompt_logprobs = req.prompt_logprobs
    defaults = defaults or {}
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = defaults.get("max_new_tokens") if max_tokens is None else max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else defaults.get("max_new_tokens", 16)  # OpenAI's
        logprobs = req.logprobs
        if req.echo and logprobs is not None:  # the echoed prompt's tokens carry theirs too
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return GenerationParams(sampling_params(req, logprobs, index, defaults, tokenizer), max_tokens=max_tokens,
                            min_tokens=req.min_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                            ignore_eos=req.ignore_eos, grammar=grammar_text, thinking=thinking,
                            prompt_logprobs=prompt_logprobs, adapter=adapter)


@dataclass
class Checked:
    """An API request's choices, checked in a worker thread, ready to become a Generation on
    the event loop, and how to read what they write."""

    submissions: list[Submission]
    reading: Reading = field(default_factory=Reading)


async def start_generation(state: ServerState, req, id_prefix: str,
                           fit_context: bool = False) -> tuple[Generation, Reading]:
    """Every choice of a chat or completion request, checked off the event loop, as one
    Generation ready to run, and how to read its text. fit_context: a chat's max_tokens is held
    to what the context leaves after its prompt."""
    checked = await off_loop(state, check_request, state, req, fit_context)
    return Generation(state.engine, checked.submissions, id_prefix, state.request_timeout), checked.reading


def check_request(state: ServerState, req, fit_context: bool = False) -> Checked:
    """A chat or completion request's prompts rendered and tokenized, its output format
    compiled, and every choice checked by the engine: the pure part, run in a worker thread."""
    engine, tokenizer = state.engine, state.tokenizer
    adapter = adapter_for(state, req)
    grammar_text, field = grammar(req)
    tools = ToolUse.of(req, state.tool_format) if isinstance(req, ChatCompletionRequest) else None
    if tools is not None:
        if grammar_text is not None:
            raise APIError(400, f"give one output format, not tools and {field}", param=field)
        grammar_text, field = tools.grammar(), "tools"
    if not isinstance(req, ChatCompletionRequest):
        prompts = completion_prompts(req, tokenizer)
        params = (generation_params(req, index, grammar_text, defaults=state.sampling_defaults, tokenizer=tokenizer,
                                    adapter=adapter) for index in range(len(prompts) * req.n))
        return Checked(check_choices(engine, prompts, req.n, params, field))
    prompt = chat_prompt(tokenizer, req.messages, tools, req.add_generation_prompt, req.template_variables(),
                         state.tool_format)
    if fit_context and req.max_tokens is not None:
        req = req.model_copy(update={"max_tokens": max(1, min(req.max_tokens, state.max_model_len - len(prompt)))})
    thinking = budget(state.reasoning, tokenizer, prompt, req.max_thinking_tokens,
                      tools is not None and tools.choice != "auto")
    inside = opens_thinking(tokenizer, prompt) if state.reasoning == THINK else None
    if grammar_text is not None and inside is not None:
        grammar_text = after_thinking(tokenizer, grammar_text, inside)
    elif grammar_text is not None and state.reasoning == HARMONY and field != "tools":
        grammar_text = after_analysis(tokenizer, grammar_text)
    elif grammar_text is not None and state.reasoning == XTML:
        grammar_text = xtml.after_thought(tokenizer, grammar_text, xtml.opened(tokenizer, prompt), field == "tools")
    params = (generation_params(req, index, grammar_text, thinking, state.sampling_defaults, tokenizer, adapter)
              for index in range(req.n))
    reading = Reading(tools, inside, whole_reader(state.reasoning, tokenizer, prompt, tools), think_tags=tokenizer.think_tags or THINK_TAGS[0])
    return Checked(check_choices(engine, [prompt], req.n, params, field), reading)


def adapter_for(state: ServerState, req):
    """The LoRA adapter the request runs with (model.lora.AdapterUse), or None."""
    if state.adapters is not None:
        return state.adapters.use_for(req.model, getattr(req, "lora", None))
    if getattr(req, "lora", None):
        raise APIError(400, "this server serves no LoRA adapters (start it with --lora or --lora-modules)",
                       param="lora")
    return None


def check_embeddings(state: ServerState, req) -> list[Submission]:
    """An embeddings request's inputs tokenized and checked, one choice each (in a worker thread)."""
    inputs = completion_prompts(req, state.tokenizer, "input")
    adapter = adapter_for(state, req)
    return check_choices(state.engine, inputs, 1, (GenerationParams(max_tokens=1, embed=True, adapter=adapter)
                                                   for _ in inputs))


def chat_tokens(state: ServerState, req) -> list[int]:
    """The prompt ids a chat-shaped request (a chat, /tokenize's messages, a render) renders to,
    with the tools it offers."""
    return chat_prompt(state.tokenizer, req.messages, ToolUse.of(req, state.tool_format), req.add_generation_prompt,
                       req.template_variables(), state.tool_format)


def chat_prompt(tokenizer, messages, tools: ToolUse | None, add_generation_prompt: bool,
                template_variables: dict | None = None, tool_format: ToolFormat | None = None) -> list[int]:
    """The token ids of a conversation after the chat template, with the tools it offers and
    the request's own template variables (chat_template_kwargs, reasoning_effort); earlier
    calls in tool_format (the server's) when the request offers no tools."""
    dicts = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
    if tokenizer.template_reads_thinking:
        dicts = [{("thinking" if k == "reasoning_content" else k): v for k, v in m.items()} for m in dicts]
    if not tokenizer.template_writes_late_system:
        dicts = system_first(dicts)
    dicts, extra = prompt_messages(dicts, tools, tokenizer.template_takes_tools, tool_format,
                                   tokenizer.template_takes_object_arguments, tokenizer.template_writes_calls)
    if not tokenizer.template_takes_system:
        dicts = system_in_first_user(dicts)
    try:
        return tokenizer.encode_chat(dicts, add_generation_prompt, **(template_variables or {}), **extra)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def system_first(messages: list[dict]) -> list[dict]:
    """The conversation with every system message joined, in order, into one at the top: how a
    template that takes a system prompt only first (Qwen3's, Gemma's, Mistral's) reads the
    system messages an agent puts later (Claude Code's), as DeepSeek's template does itself."""
    if not any(m["role"] == "system" for m in messages[1:]):
        return messages
    system = [m for m in messages if m["role"] == "system"]
    joined = {"role": "system", "content": "\n\n".join(m["content"] for m in system)}
    return [joined] + [m for m in messages if m["role"] != "system"]


def system_in_first_user(messages: list[dict]) -> list[dict]:
    """The conversation with its system message (one, by now: system_first) put at the head of
    the first user message, for a template that refuses a system role (Gemma 2's), as Gemma 3's
    template does itself; a system message is also where the tools are described."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], messages[1:]
    at = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if at is None:
        return [{"role": "user", "content": system}] + rest
    return rest[:at] + [{**rest[at], "content": f'{system}\n\n{rest[at]["content"]}'}] + rest[at + 1:]


def completion_prompts(req, tokenizer, field: str = "prompt") -> list[list[int]]:
    """The token ids of each prompt (or embedding input: field "input") a request gives: a
    string, strings, token ids, or lists of them."""
    p = getattr(req, field)
    if isinstance(p, str):
        return [tokenizer.encode(p)]
    if not p:
        raise APIError(400, f"{field} is empty", param=field)
    if all(isinstance(x, str) for x in p):
        return [tokenizer.encode(x) for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]
