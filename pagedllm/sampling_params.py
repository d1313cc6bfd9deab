"""What one request asks for. Every field is checked here, so bad input fails before it runs;
the bounds are pagedllm.sampling_bounds' table (validated means runnable)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.sampling_bounds import (  # noqa: F401  (the limits, importable from here too)
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    MIN_TOP_P,
    check_list_length,
    check_number,
)
from pagedllm.structured.spec import GrammarSpec, spec_from_structured_outputs


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a running request carries (vLLM's names)."""

    # Everything so far, every step; token_ids and logprobs are the request's own lists, which
    # keep growing while it runs (copy them to keep a snapshot), as in vLLM.
    CUMULATIVE = "cumulative"
    DELTA = "delta"  # only what is new since the last output: text, token ids, logprobs
    FINAL_ONLY = "final_only"  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: with logprobs, each token's alternatives are these tokens (whatever their rank,
    # from the raw logits as the others) instead of the `logprobs` likeliest.
    logprob_token_ids: list[int] | None = None
    # Log-probabilities of the prompt's tokens (with this many top alternatives each); the
    # first token has none. Such a request reads nothing from the prefix cache.
    prompt_logprobs: int | None = None
    # Token id -> added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (as vLLM's bad_words)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Decoding constrained to a grammar (pagedllm.structured): a GrammarSpec, or vLLM's
    # structured_outputs object as a dict, exactly one of {"json": schema}, {"regex": ...},
    # {"choice": [...]}, {"grammar": ...}, {"json_object": True} (plus "disable_any_whitespace").
    # Kept as the GrammarSpec: plain data, which is what crosses into the engine core.
    structured_outputs: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = spec_from_structured_outputs(self.structured_outputs)
        self._validate()
        # The sampler compares masses in float32, where a top_p under ~1.4e-45 is 0 and would
        # drop every token (a reply of repeated EOS). Any top_p at or under MIN_TOP_P already
        # keeps the most likely token only (the second's mass before it is at least 1 / vocab).
        self.top_p = max(self.top_p, MIN_TOP_P)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        for name in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens"):
            check_number(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):  # None: unset
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name))
        # Any top_k at or above the vocabulary means every token; past MAX_TOP_K (above every
        # vocabulary) it would overflow the sampler's int64 tensor, so it is kept at MAX_TOP_K.
        self.top_k = min(self.top_k, MAX_TOP_K)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"at most max_tokens ({self.max_tokens})", self.min_tokens)
        self._validate_token_rules()
        check_list_length("stop", len(self.stop))
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN, "stop",
                   f"non-empty strings of at most {MAX_STOP_STRING_LEN} characters", repr(s)[:40])
        check_list_length("stop_token_ids", len(self.stop_token_ids))
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", "non-negative integers", t)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               "a RequestOutputKind", self.output_kind)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, GrammarSpec),
               "structured_outputs", "a GrammarSpec, a structured_outputs dict or None",
               self.structured_outputs)

    def _validate_token_rules(self) -> None:
        """logit_bias, allowed_token_ids and bad_words (their ids' vocabulary range is checked
        by the input processor, which knows the vocabulary)."""
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "a dict of token id -> bias",
                   type(self.logit_bias).__name__)
            check_list_length("logit_bias", len(self.logit_bias))
            bad = [k for k in self.logit_bias if not (_is_int(k) and k >= 0)]
            _check(not bad, "logit_bias", "keyed by token ids (non-negative integers)", bad[:10])
            bad = {k: v for k, v in self.logit_bias.items()
                   if not (_is_num(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS)}
            _check(not bad, "logit_bias", f"numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                   dict(list(bad.items())[:10]))
        if self.allowed_token_ids is not None:
            check_list_length("allowed_token_ids", len(self.allowed_token_ids))
            ok = self.allowed_token_ids and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
            _check(bool(ok), "allowed_token_ids", "a non-empty list of token ids (non-negative "
                   "integers)", self.allowed_token_ids[:10])
        if self.logprob_token_ids is not None:
            check_list_length("logprob_token_ids", len(self.logprob_token_ids))
            ok = self.logprob_token_ids and all(_is_int(t) and t >= 0 for t in self.logprob_token_ids)
            _check(bool(ok), "logprob_token_ids", "a non-empty list of token ids (non-negative "
                   "integers)", self.logprob_token_ids[:10])
            _check(self.logprobs is not None, "logprob_token_ids", "given with logprobs (they are "
                   "the alternatives its logprobs list)", self.logprob_token_ids[:10])
        if self.bad_words is not None:
            check_list_length("bad_words", len(self.bad_words))
            for word in self.bad_words:
                _check(isinstance(word, str) and 0 < len(word.strip()) <= MAX_STOP_STRING_LEN,
                       "bad_words", f"words of 1 to {MAX_STOP_STRING_LEN} characters (not only "
                       "spaces)", repr(word)[:40])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    """A finite number (NaN and the infinities are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value - value == 0


def _check(ok: bool, name: str, allowed: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {got!r}")
