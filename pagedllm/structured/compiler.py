"""Compile a GrammarSpec against one tokenizer, bounded in time and size, cached.

Compiling builds llguidance's parser and lexer for the spec and computes the first token mask
(the lexer is built lazily: the first mask is where a large regex pays, up to hundreds of ms, so
it is paid here and not inside an engine step). The result is a pristine matcher kept as a
template; each request gets a deep copy, which shares the compiled lexer and its caches.

Bounds, so a pathological spec is a 400 and never a stuck server:
- spec.py bounds the text (size, nesting, counted repetitions) before anything is built;
- llguidance's own limits (LLParserLimits below) bound the grammar's size and the lexer's work
  and memory, failing with a message;
- a wall-clock limit: compile() waits compile_timeout_s at most. The build runs on a small thread
  pool (llguidance releases the GIL while it builds), so a request that times out gets its error
  at once while the build finishes in the background. Only the build's own CPU time decides
  whether the spec is too costly (remembered as failed): a wait caused by other requests' builds
  occupying the pool, or by a busy machine, is that request's error only, never the spec's
  verdict, so an ordinary schema sent again after a busy period compiles (issue 32, finding 6).
  Measured worst cases inside the other bounds (2 cores, SmolLM2's 49k vocabulary): 2^7
  inline-duplicated anyOf subschemas 35 ms, 3,000 required properties 0.2 s, an 8,000-way Lark
  alternative 0.14 s; a 20-deep version of the first took 10 s before llguidance refused it,
  which the depth bound and the wall-clock limit now stop.

The cache is per compiler, and a compiler is per tokenizer: the key is (tokenizer, spec).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy

from pagedllm.structured.reasoning_grammar import after_reasoning
from pagedllm.structured.schema import grammar_schema
from pagedllm.structured.spec import GrammarSpec, JsonWhitespace
from pagedllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedllm.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 2.0
DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 500

# llguidance's defaults, tightened where a default lets one grammar take seconds or hundreds of MB.
_LIMITS = dict(
    max_grammar_size=100_000,  # symbols in the grammar's productions (default 500,000)
    max_lexer_states=50_000,  # lexer DFA states, about 1-2 kB each (default 250,000)
    verbose_errors=False,  # the parser's state dump is for debugging, not for a 400's message
)
_JSON_OPTIONS: dict[JsonWhitespace, dict] = {
    "spaced": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "flexible": {"whitespace_flexible": True},
}


class GrammarError(ValueError):
    """A spec the library cannot compile, or not within the bounds."""


def llguidance_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer: it reads the `tokenizers` backend's JSON, which we have
    for Hugging Face folders and GGUF vocabularies alike. Its EOS tokens are ours (an instruct
    model's end-of-turn tokens included): the grammar allows them exactly where it may end."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                  eos_token=tokenizer.eos_token_ids or None)


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON envelope, or Lark text) for a spec: after the model's
    reasoning, where the spec says so."""
    if spec.reasoning is not None:
        answer = None if spec.kind == "text" else _answer_grammar(spec)
        return after_reasoning(spec.reasoning, answer)
    return _answer_grammar(spec)


def _answer_grammar(spec: GrammarSpec) -> str:
    if spec.kind == "text":
        return llguidance.LLMatcher.grammar_from_regex("(?s:.*)")
    if spec.kind in ("json_schema", "json_object"):
        schema = grammar_schema(json.loads(spec.text)) if spec.kind == "json_schema" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=_JSON_OPTIONS[spec.whitespace])
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    # "choice" becomes a Lark alternation of the literal strings; "grammar" is GBNF or Lark.
    return llguidance.grammar_from(spec.kind, spec.text)


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError if the spec does not compile (no tokenizer needed: a quick check of
    the grammar itself, as for tool parameter schemas)."""
    message = llguidance.LLMatcher.validate_grammar(_grammar_or_raise(spec), None,
                                                    limits=llguidance.LLParserLimits(**_LIMITS))
    if message:
        raise GrammarError(_error_text(spec, message))


class CompiledGrammar:
    """A spec compiled for one tokenizer: hands out fresh matchers."""

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, vocab_size: int,
                 tokenizer: llguidance.LLTokenizer | None = None):
        self.spec = spec
        self.vocab_size = vocab_size  # the tokenizer's; a bitmask row covers this many ids
        self._template = template  # never advanced: only copied
        self._tokenizer = tokenizer  # for a thinking budget's matcher (the marker's tokens)

    def matcher(self) -> GrammarMatcher:
        # Here, not at the top: compiling needs no torch (the API process of `pagedllm serve`
        # compiles to check a request; only the engine core makes matchers).
        from pagedllm.structured.matcher import GrammarMatcher

        prefix = self.spec.reasoning
        if prefix is not None and prefix.budget is not None:
            from pagedllm.structured.reasoning_budget import ReasoningBudgetMatcher

            return ReasoningBudgetMatcher(self._template, self.vocab_size, prefix, self._tokenizer)
        return GrammarMatcher(self._template, self.vocab_size)


class GrammarCompiler:
    """Compiles specs for one tokenizer on a small thread pool, with an LRU cache of results
    (failures included, so a bad spec sent again costs nothing).

    Making one is free: llguidance's view of the tokenizer (0.5-1 s, tens of MB) is built on the
    first submit, in the caller's thread and outside the compile time limit, so an engine that is
    never asked for structured output never pays for it."""

    def __init__(self, tokenizer: Tokenizer, *, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 2):
        if compile_timeout_s <= 0 or cache_size < 1 or max_threads < 1:
            raise ValueError("compile_timeout_s must be > 0, cache_size and max_threads >= 1")
        self._tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size: int = tokenizer.vocab_size  # llguidance's too (llguidance_tokenizer)
        self.compile_timeout_s = compile_timeout_s
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, waiting compile_timeout_s at most; GrammarError (a ValueError)
        if it does not compile or takes longer."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            # Not remembered: the build goes on, and its own CPU time gives the spec's verdict.
            started = future.running() or future.done()
            raise GrammarError(
                f"compiling the {spec.kind} took longer than {self.compile_timeout_s:g} s; " + (
                    "simplify it (fewer alternatives, shallower nesting, shorter repetitions)"
                    if started else "it waited for the grammar compilers, busy with other "
                    "requests: send it again")) from None

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Start compiling (or find the cached result) without waiting; for a caller that polls,
        like an engine step loop. The future's exception is a GrammarError."""
        self._build_tokenizer()
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._build, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _build_tokenizer(self) -> None:
        with self._lock:
            if self._ll_tokenizer is None:
                started = time.perf_counter()
                self._ll_tokenizer = llguidance_tokenizer(self._tokenizer)
                logger.info("grammar tokenizer built in %.2f s", time.perf_counter() - started)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for spec (compiling it first if needed)."""
        return self.compile(spec).matcher()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        started = time.perf_counter()
        cpu_started = time.thread_time()  # this thread's CPU: not the wait for a core or the pool
        template = llguidance.LLMatcher(self._ll_tokenizer, _grammar_or_raise(spec), log_level=0,
                                        limits=llguidance.LLParserLimits(**_LIMITS))
        if template.is_error():
            raise GrammarError(_error_text(spec, template.get_error()))
        for warning in template.get_grammar_warnings():
            logger.info("grammar %s: %s", spec.describe(), warning)
        scratch = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(template, scratch)  # builds the lexer's start
        if template.is_error():
            raise GrammarError(_error_text(spec, template.get_error()))
        if time.thread_time() - cpu_started > self.compile_timeout_s:  # the spec's own cost
            raise GrammarError(
                f"compiling the {spec.kind} took longer than {self.compile_timeout_s:g} s; "
                "simplify it (fewer alternatives, shallower nesting, shorter repetitions)")
        logger.debug("compiled %s in %.1f ms", spec.describe(), (time.perf_counter() - started) * 1e3)
        return CompiledGrammar(spec, template, self.vocab_size, self._ll_tokenizer)


def _grammar_or_raise(spec: GrammarSpec) -> str:
    try:
        return llguidance_grammar(spec)
    except ValueError as exc:  # bad JSON text, or a GBNF grammar that does not convert
        raise GrammarError(_error_text(spec, str(exc))) from None


def _error_text(spec: GrammarSpec, message: str) -> str:
    message = message.strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return f"invalid {spec.kind.replace('_', ' ')}: {message}"
