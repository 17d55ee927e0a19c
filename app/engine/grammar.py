"""Grammar-constrained decoding through llguidance (the engine vLLM, SGLang and llama.cpp use).

A grammar (llguidance's JSON or Lark text; the server makes it from a JSON schema) is compiled
once and kept in a bounded LRU as a pristine matcher; each request gets a copy, which follows
its tokens. Before a row samples, its matcher gives a bitmask of the tokens allowed next (one
bit per token id, in int32 words), which the sampler applies before its own filters. Masks
are computed on one thread of their own (llguidance releases the GIL), while the forward pass
runs on the engine's.

The server checks a request's grammar in its own worker threads (off the event loop) while the
engine takes matchers on the Trio thread, so the LRU is locked; compiling happens outside the
lock, so a slow grammar never holds up the event loop's cache hits.
"""

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np


CACHE_SIZE = 64  # compiled grammars kept


class Grammars:
    def __init__(self, tokenizer, capacity: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._llt = None
        self._llt_lock = threading.Lock()
        self._lock = threading.Lock()  # around compiled, read and written from several threads
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="spool-masks")

    def later(self, fn, *args) -> Future:
        """fn(*args) on the mask thread, in submission order."""
        return self._thread.submit(fn, *args)

    @property
    def llt(self) -> llguidance.LLTokenizer:
        """Built on the first grammar (a fraction of a second), from the tokenizer's own JSON."""
        with self._llt_lock:
            if self._llt is None:
                tok = self.tokenizer
                self._llt = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size,
                                                   eos_token=sorted(tok.eos_token_ids))
            return self._llt

    def pristine(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar; ValueError with llguidance's message when it cannot compile."""
        with self._lock:
            matcher = self.compiled.get(grammar)
            if matcher is not None:
                self.compiled.move_to_end(grammar)
                return matcher
        matcher = llguidance.LLMatcher(self.llt, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self.compiled[grammar] = matcher
            while len(self.compiled) > self.capacity:
                self.compiled.popitem(last=False)
        return matcher

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return self.pristine(grammar).deep_copy()

    def only(self, token: int) -> np.ndarray:
        """A mask that allows one token."""
        words = np.zeros(-(-self.tokenizer.vocab_size // 32), dtype=np.uint32)
        words[token // 32] = np.uint32(1 << (token % 32))
        return words.view(np.int32)

    def mask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The tokens allowed next, as int32 words of bits (token t: bit t % 32 of word t // 32)."""
        words = llg_numpy.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llg_numpy.fill_next_token_bitmask(matcher, words)
        return words[0]
