"""Text in and out: the model's tokenizer.json, its chat template and its end-of-generation set.

The chat template is rendered the way transformers renders it (model/chat_sandbox.py), so
prompts match what the model was trained on.
"""

import json
from functools import cached_property
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from model.chat_sandbox import ChatTemplateError, RenderBounds, bounds, environment
from model.errors import ModelError


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path} ({e}); re-download or re-convert the model") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def chat_template_text(value: str | None) -> str | None:
    """A --chat-template value as Jinja text: a file's contents, or the template given inline
    (it has a {{ or {% in it), as vLLM reads the flag; None stays None."""
    if value is None:
        return None
    path = Path(value)
    if "{{" not in value and "{%" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        return path.read_text(encoding="utf-8")
    return value


PROBE_ARGUMENTS = {"probe_key": "probe_value"}  # a tool call's, for what the chat template does with one


# thinking tags: Qwen3's and DeepSeek-R1's, Mistral's (Magistral, Ministral 3 reasoning)
THINK_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<mm:think>", "</mm:think>"))

class Tokenizer:
    def __init__(self, model_dir: Path, chat_template: str | None = None, render_seconds: float | None = None,
                 render_chars: int | None = None):
        """chat_template: Jinja text in place of the model's own (--chat-template).
        render_seconds, render_chars: the most one chat render may take (None: no bound)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(
                f"{model_dir} has no tokenizer.json; Spool needs a fast (tokenizers) tokenizer:"
                " save one with transformers' tokenizer.save_pretrained, or pass a .gguf file"
            )
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelError(f"cannot load {path} ({e}); re-download or re-convert the model") from None
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.special_tokens = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False))

        eos = set(_ids(gen.get("eos_token_id"))) | set(_ids(model_cfg.get("eos_token_id")))
        if self.eos_token and self.hf.token_to_id(self.eos_token) is not None:
            eos.add(self.hf.token_to_id(self.eos_token))
        # harmony's ends (GPT-OSS's): <|return|> after an answer, <|call|> after a tool call,
        # however the model's files list them (a GGUF's eos is <|return|> alone)
        eos |= {i for i in map(self.hf.token_to_id, ("<|return|>", "<|call|>")) if i is not None}
        self.eos_token_ids = frozenset(eos)
        # a reasoning model's thinking tags, as text and as ids: the first pair its vocabulary has
        self.think_tags = next((tags for tags in THINK_TAGS if None not in map(self.hf.token_to_id, tags)), None)
        self.think_ids = None if self.think_tags is None else tuple(map(self.hf.token_to_id, self.think_tags))
        self.skipped_ids: frozenset[int] | None = None  # set by keep_in_text: what decode drops

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if chat_template is not None:
            template = chat_template
        self.chat_template = None
        self.chat_template_source = template or ""  # read for the tool-call format it writes
        self.template_takes_tools = bool(template) and "tools" in template
        self.render_seconds, self.render_chars = render_seconds, render_chars
        if template:
            try:
                self.chat_template = environment().from_string(template)
            except jinja2.TemplateError as e:
                raise ModelError(f"the chat template in {model_dir} does not parse ({e}); fix tokenizer_config.json") from None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while it works, where encode holds it
        # throughout, so a long prompt tokenized in a server's worker thread would stall its event loop
        ids = self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def keep_in_text(self, ids: set[int]) -> None:
        """Special tokens that decode keeps even when it skips the others: a tool-call format's
        markers (Mistral's [TOOL_CALLS] is a control token), which its parser reads."""
        special = {i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        if special & set(ids):
            self.skipped_ids = frozenset(special - set(ids))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self.skipped_ids is not None:
            return self.hf.decode([i for i in ids if i not in self.skipped_ids], skip_special_tokens=False)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for a conversation; raises ChatTemplateError for messages the
        template rejects."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        limits = RenderBounds(self.render_seconds, self.render_chars)
        token = bounds.set(limits)
        parts, chars = [], 0
        try:
            for part in self.chat_template.generate({**self.special_tokens, **extra}, messages=messages,
                                                    add_generation_prompt=add_generation_prompt):
                chars += len(part)
                limits.check_size(chars)
                limits.check_time()
                parts.append(part)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply rendering these messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template could not render these messages: {e}") from None
        finally:
            bounds.reset(token)
        return "".join(parts)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        # The template writes any BOS itself, as transformers' apply_chat_template assumes.
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False)

    @cached_property
    def template_writes_late_system(self) -> bool:
        """Whether the chat template writes a system message that comes later than first in a
        conversation (ChatML's and Llama 3's do; Qwen3's, Gemma's and Mistral's refuse one, and
        some drop it): rendered once, on a conversation that needs it."""
        probe = "A late system message."
        turns = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                 {"role": "system", "content": probe}, {"role": "user", "content": "Bye."}]
        try:
            return probe in self.render_chat(turns)
        except ChatTemplateError:
            return False

    @cached_property
    def template_takes_system(self) -> bool:
        """Whether the chat template takes a system message at all (Gemma 2's refuses one)."""
        probe = "A system message."
        try:
            return probe in self.render_chat([{"role": "system", "content": probe}, {"role": "user", "content": "Hi."}])
        except ChatTemplateError:
            return False

    @property
    def template_reads_thinking(self) -> bool:
        """Whether the chat template reads an assistant's earlier reasoning as `thinking`
        (GPT-OSS's, LFM2.5's), not as reasoning_content, the field clients send it back in."""
        source = self.chat_template_source
        return "message.thinking" in source and "reasoning_content" not in source

    def _render_call(self, arguments) -> str | None:
        """A conversation with one tool call, rendered with no tools offered (so the argument's
        key shows only where the call is written); None where the template refuses it."""
        call = {"id": "call12345", "type": "function", "function": {"name": "probe", "arguments": arguments}}
        try:
            return self.render_chat([{"role": "user", "content": "Hello."},
                                     {"role": "assistant", "content": "", "tool_calls": [call]}], False)
        except ChatTemplateError:
            return None

    @cached_property
    def template_writes_calls(self) -> bool:
        """Whether the chat template writes an assistant's tool calls itself: its source reads
        tool_calls, and a call's arguments show in what it renders (DeepSeek R1's distills
        write calls only for a message whose content is None, where Spool passes text)."""
        if "tool_calls" not in self.chat_template_source:
            return False
        return any("probe_key" in (self._render_call(a) or "") for a in (PROBE_ARGUMENTS, json.dumps(PROBE_ARGUMENTS)))

    @cached_property
    def template_takes_object_arguments(self) -> bool:
        """Whether the chat template writes a tool call's arguments given as an object, as
        transformers and vLLM pass them (most write them as JSON, or key by key); one that adds
        them to a string (Functionary's) or writes them bare, as Python's repr, gets the JSON
        text instead, as llama.cpp finds out the same way. Rendered once, on a call."""
        as_object = self._render_call(PROBE_ARGUMENTS)
        if as_object is not None and "{'probe_key'" not in as_object:
            return True
        return self._render_call(json.dumps(PROBE_ARGUMENTS)) is None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    It decodes a short window of recent ids and releases only text that is settled: while the
    window's text ends in U+FFFD (an incomplete multi-byte sequence), nothing is released.
    A few prompt ids seed the window so tokenizers that strip a leading space (SentencePiece)
    still space the first word right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), context: int = 6):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-context:]) if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of a generation."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
