"""The one table of what a SamplingParams field may hold: validated means runnable.

Every bound here is one the core, the sampler and the kernels can run, so a request that passes
cannot fail a step (and with it every other request in that step). The offline API checks it in
SamplingParams, the server derives its pydantic fields from it (a 400 naming the field, and the
limits shown in /openapi.json), and the core checks again on arrival (check_runnable, from the
scheduler's admission check): a request from another client of the core is not trusted either.

Why each bound:
- integers go into torch tensors (int64) and C++ kernels (int32 lengths): counts are bounded to
  INT32_MAX, a seed to int64. top_k is clamped instead of refused: any top_k at or above the
  vocabulary means "every token" (the input processor clamps it to the vocabulary itself).
- floats must be finite and in the range the sampler's arithmetic means (NaN compares false with
  every bound, so an unchecked NaN would pass a range check written the wrong way round).
- lists are bounded because each entry costs work in every step (stop strings and bad words are
  matched after every token, logit_bias and allowed_token_ids become masks): a request's work
  per step is bounded by what the table lets it ask for.
- logprobs counts (logprobs, prompt_logprobs; the server's top_logprobs) are the one bound the
  engine sets: its max_logprobs (vLLM's --max-logprobs, default MAX_LOGPROBS; -1 the whole
  vocabulary), held to the model's vocabulary (torch.topk takes no more), so logprobs_cap needs
  both. Each alternative is an entry per token in the output, so the operator chooses the cost.
  The table itself only says "an int32, or -1": -1 (vLLM's "the whole vocabulary") is resolved
  by the input processor, which knows the vocabulary, and the core takes no -1.
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default: EngineConfig.max_logprobs's
WHOLE_VOCABULARY = -1  # as a logprobs count or max_logprobs: every token of the model's vocabulary
MAX_N = 64
MAX_TOP_K = INT32_MAX  # above any vocabulary: a larger top_k means the same, and is clamped to this
MAX_TOKENS = INT32_MAX  # max_tokens and min_tokens (positions are int32 in the kernels)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64  # each one is checked after every token
MAX_BAD_WORDS = 128  # each one is checked against the output after every token
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
# logit_bias entries: each is a scatter into every step's logits and, in the server, JSON parsed
# on the event loop; 1,024 biased tokens is far past any use seen (OpenAI takes 300).
MAX_LOGIT_BIAS_ENTRIES = 1024
# allowed_token_ids: at most one entry per token of the largest vocabularies (262,144, Gemma 3);
# the input processor bounds it by the model's own vocabulary too (repeats mean nothing).
MAX_ALLOWED_TOKEN_IDS = 2**18
MIN_TOP_P = 1e-9  # smaller top_p values mean the same (the top token) and are raised to it


@dataclass(frozen=True)
class NumberBound:
    """A number field's range: [low, high], either end open where said. kind "int" takes
    integers only (not bools), "float" any finite int or float."""

    kind: str
    low: float
    high: float
    low_open: bool = False
    clamp_high: bool = False  # values above high mean high (kept as high) rather than an error

    def describe(self) -> str:
        noun = "an integer" if self.kind == "int" else "a number"
        left = "(" if self.low_open else "["
        return f"{noun} in {left}{_fmt(self.low)}, {_fmt(self.high)}]"

    def admits(self, value: object) -> bool:
        if not (_is_int(value) if self.kind == "int" else _is_finite(value)):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (self.clamp_high or value <= self.high)

    def pydantic(self) -> dict:
        """The pydantic Field constraints that say the same (no upper one where it clamps)."""
        kwargs = {"gt" if self.low_open else "ge": self.low}
        if not self.clamp_high:
            kwargs["le"] = self.high
        return kwargs


def _int(low, high, **kw) -> NumberBound:
    return NumberBound("int", low, high, **kw)


def _float(low, high, **kw) -> NumberBound:
    return NumberBound("float", low, high, **kw)


# SamplingParams' number fields. None (where a field allows it) is checked by SamplingParams.
NUMBER_BOUNDS: dict[str, NumberBound] = {
    "n": _int(1, MAX_N),
    "temperature": _float(0.0, 100.0),
    "top_p": _float(0.0, 1.0, low_open=True),
    "top_k": _int(-1, MAX_TOP_K, clamp_high=True),  # -1 or 0: all tokens
    "min_p": _float(0.0, 1.0),
    "presence_penalty": _float(-2.0, 2.0),
    "frequency_penalty": _float(-2.0, 2.0),
    "repetition_penalty": _float(0.0, 2.0, low_open=True),
    "seed": _int(INT64_MIN, INT64_MAX),
    "max_tokens": _int(1, MAX_TOKENS),
    "min_tokens": _int(0, MAX_TOKENS),
    # the engine's cap (logprobs_cap) bounds them further
    "logprobs": _int(WHOLE_VOCABULARY, INT32_MAX),
    "prompt_logprobs": _int(WHOLE_VOCABULARY, INT32_MAX),
}

# List fields: the most entries each may have.
LIST_BOUNDS: dict[str, int] = {
    "stop": MAX_STOP_STRINGS,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "bad_words": MAX_BAD_WORDS,
    "logit_bias": MAX_LOGIT_BIAS_ENTRIES,
    "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
    # vLLM's pinned alternatives: each one an entry per token, as a logprobs count's are
    "logprob_token_ids": MAX_LOGPROBS,
}


def check_number(name: str, value: object) -> None:
    bound = NUMBER_BOUNDS[name]
    if not bound.admits(value):
        raise ValueError(f"{name} must be {bound.describe()}; got {_short(value)}")


def check_list_length(name: str, length: int) -> None:
    if length > LIST_BOUNDS[name]:
        raise ValueError(f"{name} must have at most {LIST_BOUNDS[name]} entries; got {length}")


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most alternatives per token an engine with this max_logprobs lists for this model."""
    return vocab_size if max_logprobs == WHOLE_VOCABULARY else min(max_logprobs, vocab_size)


def check_logprob_counts(params, max_logprobs: int, vocab_size: int) -> None:
    """ValueError naming the field unless params' logprobs counts are within the engine's cap
    (a -1 must have been resolved to the vocabulary's size before: the input processor's)."""
    cap = logprobs_cap(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        count = getattr(params, name)
        if count is not None and not 0 <= count <= cap:
            raise ValueError(f"{name} must be at most {cap} {cap_reason(max_logprobs, vocab_size)}; "
                             f"got {_short(count)}")


def cap_reason(max_logprobs: int, vocab_size: int) -> str:
    """Where logprobs_cap's number comes from, and how to raise it, for an error message."""
    if logprobs_cap(max_logprobs, vocab_size) == vocab_size:
        return f"(the model's vocabulary: {vocab_size} tokens)"
    return (f"(the engine's --max-logprobs; start it with a larger --max-logprobs, or -1 for the "
            f"whole vocabulary of {vocab_size} tokens, to list more)")


def check_runnable(params, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
    """ValueError naming the field unless params (a SamplingParams, possibly decoded from another
    process without its checks) holds only what a step can run: the table's bounds, and, given
    vocab_size, token ids in the vocabulary and logprobs counts within max_logprobs's cap
    (default MAX_LOGPROBS). The core's check on arrival."""
    for name in NUMBER_BOUNDS:
        value = getattr(params, name)
        if value is not None or name not in _MAY_BE_NONE:
            check_number(name, value)
    for name in LIST_BOUNDS:
        value = getattr(params, name)
        if value is not None:
            check_list_length(name, len(value))
    if params.top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be at most {MAX_TOP_K} (larger values mean every token: "
                         f"SamplingParams clamps them); got {_short(params.top_k)}")
    if vocab_size is not None:
        ids = [*params.stop_token_ids, *(params.logit_bias or ()), *(params.allowed_token_ids or ()),
               *(params.logprob_token_ids or ())]
        bad = [t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab_size}) (the vocabulary); "
                             f"got {bad[:10]}")
        check_logprob_counts(params, MAX_LOGPROBS if max_logprobs is None else max_logprobs, vocab_size)


_MAY_BE_NONE = frozenset({"seed", "max_tokens", "logprobs", "prompt_logprobs"})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    # value - value is 0 for finite numbers, NaN for inf and NaN
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value - value == 0


def _fmt(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"
