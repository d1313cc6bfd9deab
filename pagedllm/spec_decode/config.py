"""Speculative decoding settings in vLLM's shape, validated here and nowhere else.

`speculative_config` is a dict or its JSON text:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
     "suffix_decoding_max_cached_requests": 1000}
    {"method": "draft_model", "model": "/path/to/small.gguf", "num_speculative_tokens": 4}

Every refusal is one line naming the key, what it got and what is allowed. A key of another
method is refused rather than ignored: a user who wrote prompt_lookup_min for suffix decoding
believes it does something. No torch here (pagedllm.config's rule): the draft's vocabulary check
takes tokenizers, which the engine has loaded by then.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# A step verifies k + 1 positions of every speculating sequence, so k bounds its extra work. Past
# 32 even a 90% acceptance rate lengthens the expected accepted run by under 4% (it approaches
# 1 / (1 - 0.9) = 10: (1 - 0.9**33) is 97% of that) while each rejected position still costs its
# place in the batch and its KV slot.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's rule for prompt lookup: both unset -> 5 and 5; one set -> the other takes its value.
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_MAX_CACHED_REQUESTS = 1000
# Keys only one method reads.
_METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
    "draft_model": ("model",),
}
_COMMON_KEYS = ("method", "num_speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: the most tokens proposed per sequence and step
    # ngram: the longest suffix of the sequence, between these lengths, found earlier in it
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # suffix: the trees hold substrings up to this long; a proposal's match plus its tokens fit in it
    suffix_decoding_max_tree_depth: int = 24
    # finished requests whose outputs stay in the shared tree (least recently used out); 0: none.
    # vLLM's default is 10000; in Python a tree costs ~450 bytes per cached output token
    # (pagedllm.spec_decode.suffix), so 1000 outputs of 500 tokens take ~220 MiB.
    suffix_decoding_max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    # a match of m tokens proposes at most factor * m tokens
    suffix_decoding_max_spec_factor: float = 1.0
    # a proposal stops where its estimated probability (the product of the continuation
    # frequencies along it) falls below this
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the smaller model's path (same tokenizer as the target)
    model: str | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config a dict or JSON text describes (None for None or "null"); ValueError in one
        line."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object; {exc}") from None
            if value is None:  # "null": off, as leaving it out (a bench twin's plain engine)
                return None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config must be a JSON object such as "
                             "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}; "
                             f"got {value!r}")
        return cls._from_mapping(dict(value))

    @classmethod
    def _from_mapping(cls, items: dict[str, Any]) -> SpeculativeConfig:
        method = items.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}; "
                             f"got {method!r}")
        allowed = _COMMON_KEYS + _METHOD_KEYS[method]
        for key in items:
            if key not in allowed:
                owner = next((m for m, keys in _METHOD_KEYS.items() if key in keys), None)
                why = f"it applies to method {owner!r}" if owner else "no such key"
                raise ValueError(f"speculative_config: {key!r} is not a setting of method {method!r} "
                                 f"({why}); its settings are {', '.join(allowed)}")
        items = dict(items)
        if method == "suffix":
            depth = items.get("suffix_decoding_max_tree_depth", 24)
            if _is_int(depth):  # vLLM's default: as many as the tree is deep (within the limit)
                items.setdefault("num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS))
        if method == "ngram":
            low, high = items.get("prompt_lookup_min"), items.get("prompt_lookup_max")
            items["prompt_lookup_min"] = low if low is not None else (high or DEFAULT_PROMPT_LOOKUP)
            items["prompt_lookup_max"] = high if high is not None else (low or DEFAULT_PROMPT_LOOKUP)
        if "num_speculative_tokens" not in items:
            raise ValueError(f"speculative_config: method {method!r} needs num_speculative_tokens "
                             f"(1 to {MAX_SPECULATIVE_TOKENS})")
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in items.items() if k in known})
        config._validate()
        return config

    def _validate(self) -> None:
        k = self.num_speculative_tokens
        _check(_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
               f"an integer from 1 to {MAX_SPECULATIVE_TOKENS} (a step verifies k + 1 positions per "
               "sequence; past that a longer proposal gains almost nothing)", k)
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            _check(_is_int(low) and low >= 1, "prompt_lookup_min", "an integer >= 1", low)
            _check(_is_int(high) and high >= 1, "prompt_lookup_max", "an integer >= 1", high)
            if low > high:
                raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must not exceed "
                                 f"prompt_lookup_max ({high})")
        elif self.method == "suffix":
            depth = self.suffix_decoding_max_tree_depth
            _check(_is_int(depth) and 2 <= depth <= 1024, "suffix_decoding_max_tree_depth",
                   "an integer from 2 to 1024 (a match of one token and one proposed)", depth)
            cached = self.suffix_decoding_max_cached_requests
            _check(_is_int(cached) and cached >= 0, "suffix_decoding_max_cached_requests",
                   "an integer >= 0 (0: no tree of earlier requests' outputs)", cached)
            factor = self.suffix_decoding_max_spec_factor
            _check(_is_num(factor) and factor > 0, "suffix_decoding_max_spec_factor",
                   "a number > 0", factor)
            prob = self.suffix_decoding_min_token_prob
            _check(_is_num(prob) and 0 <= prob <= 1, "suffix_decoding_min_token_prob",
                   "a number from 0 to 1", prob)
        else:
            model = self.model
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs \"model\": the path "
                                 "of the draft model (a .gguf file or a Hugging Face folder)")
            if not Path(model).exists():
                raise ValueError(f"speculative_config: the draft model {model!r} does not exist")

    def describe(self) -> str:
        """The start-up line's part: what proposes and how many tokens at most."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            detail = f"prompt lookup {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens"
        elif self.method == "suffix":
            detail = (f"suffix trees {self.suffix_decoding_max_tree_depth} deep, "
                      f"{self.suffix_decoding_max_cached_requests} earlier requests cached")
        else:
            detail = f"draft model {self.model}"
        return f"speculative decoding: {self.method} ({detail}), up to {k} tokens per step"


def check_draft_vocabulary(target_vocab_size: int, draft_vocab_size: int, target_tokenizer,
                           draft_tokenizer) -> None:
    """Refuse (one line) a draft model whose proposals would mean other tokens to the target:
    another number of logits, or a tokenizer that maps any text to other ids. Tokenizers are
    pagedllm.text.tokenizer.Tokenizer (or anything with a `backend` exposing get_vocab())."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config: the draft model has {draft_vocab_size} logits, the "
                         f"target {target_vocab_size}: a draft must share the target's vocabulary")
    target, draft = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()), key=lambda item: item[1])
        token, token_id = differ[0]
        raise ValueError(f"speculative_config: the draft's tokenizer differs from the target's "
                         f"({len(draft)} tokens against {len(target)}; first at id {token_id}, "
                         f"{token!r}): a draft must share the target's tokenizer")
    for name in ("bos_token_id", "eos_token_id"):
        mine, theirs = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if mine != theirs:
            raise ValueError(f"speculative_config: the draft's {name} is {theirs}, the target's "
                             f"{mine}: a draft must share the target's tokenizer")


def _vocab(tokenizer) -> dict[str, int]:
    return tokenizer.backend.get_vocab(with_added_tokens=True)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, allowed: str, got: object) -> None:
    if not ok:
        raise ValueError(f"speculative_config: {name} must be {allowed}; got {got!r}")
