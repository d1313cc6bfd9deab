"""The input processor: the one owner of prompt validation and tokenization.

The offline LLM, LLMEngine and the server all turn what a user sent into engine-core requests
here: a prompt as text, token ids or a dict (or a chat conversation, rendered by the model's
chat template), checked once, each kind of problem with one message, and tokenized. What comes
out is an EngineCoreRequest: plain data, ready to cross into the core, in this process or
another. Bad input raises InvalidInput, a ValueError naming the request field at fault.
"""

from __future__ import annotations

import dataclasses
import time

from pagedllm.core_messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer

# One prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids[, "prompt": text]}.
PromptInput = str | list[int] | dict
Conversation = list[dict]


class InvalidInput(ValueError):
    """A request the engine cannot take; `param` names the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list: text, a dict and a list of token ids are each
    one prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # Tokenizing holds the GIL (in the server: the event loop); a 4 MiB prompt takes seconds.
        # No text longer than this can fit in max_model_len tokens, so it is refused untokenized.
        self.max_prompt_chars = max_model_len * _longest_token_chars(tokenizer)

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                *, arrival_time: float | None = None, cache_salt: str | None = None,
                max_tokens_must_fit: bool = False) -> tuple[str | None, EngineCoreRequest]:
        """The prompt's text (None if given as ids only) and the core request.

        max_tokens_must_fit (OpenAI's rule, the server's): prompt + max_tokens must fit in
        max_model_len, and max_tokens=None means all the room left. Otherwise (vLLM's offline
        rule) a request just stops at max_model_len."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt, room_for_output=max_tokens_must_fit)
        self._check_stop_token_ids(params)
        if max_tokens_must_fit:
            params = self._fit_max_tokens(params, len(token_ids))
        request = EngineCoreRequest(
            request_id, token_ids, params, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt)
        return text, request

    def tokenize(self, prompt: PromptInput, room_for_output: bool = False) -> tuple[str | None, list[int]]:
        """The checked token ids of one prompt (and its text, if it has one)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"], room_for_output)
            else:
                raise InvalidInput("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, prompt
        else:
            raise InvalidInput(f"a prompt must be a string, a list of token ids or a dict; got "
                               f"{type(prompt).__name__}")
        self._check_token_ids(token_ids, room_for_output)
        return text, list(token_ids)

    def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidInput(_EMPTY, param)
        if len(text) > self.max_prompt_chars:
            raise InvalidInput(
                f"the prompt is {len(text)} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold (at most {self.max_prompt_chars} "
                "characters): shorten it", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: Conversation, add_generation_prompt: bool = True) -> dict:
        """A conversation as one prompt, through the model's chat template: {"prompt": text,
        "prompt_token_ids": ids} (the template writes any BOS itself)."""
        if not messages:
            raise InvalidInput("messages is empty: send at least one message", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:  # no template, or the template refused the messages
            raise InvalidInput(str(exc), "messages") from exc
        except Exception as exc:  # the template itself failed (e.g. roles out of order)
            raise InvalidInput(f"the chat template could not render these messages: {exc}",
                               "messages") from exc
        return {"prompt": text, "prompt_token_ids": self.encode(text, "messages", add_special_tokens=False)}

    # -- checks ---------------------------------------------------------------------------------
    def _check_token_ids(self, token_ids, room_for_output: bool) -> None:
        if len(token_ids) == 0:
            raise InvalidInput(_EMPTY)
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"prompt token ids must be integers in [0, {vocab}) (the vocabulary); "
                               f"out of vocabulary: {bad[:5]}")
        limit = self.max_model_len - 1 if room_for_output else self.max_model_len
        if len(token_ids) > limit:
            leaves = ", which leaves no room for a completion" if len(token_ids) <= self.max_model_len else ""
            raise InvalidInput(f"this model's maximum context length is {self.max_model_len} tokens "
                               f"(max_model_len) and the prompt has {len(token_ids)}{leaves}: "
                               "shorten it")

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidInput(f"stop_token_ids must be in [0, {self.vocab_size}) (the vocabulary); "
                               f"out of vocabulary: {bad[:5]}", "stop_token_ids")

    def _fit_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise InvalidInput(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {num_prompt_tokens} "
                f"input tokens ({params.max_tokens} + {num_prompt_tokens} > {self.max_model_len})",
                "max_tokens")
        return params


_EMPTY = "the prompt is empty: give at least one character or token id"


def _longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry (in
    byte-level and metaspace vocabularies an entry is at least as long as the text it decodes
    to). Without a vocabulary to look at, no bound."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(len(token) for token in vocab)
    except Exception:  # another kind of tokenizer: always tokenize
        return 2**40
