"""The answers' shapes: completions and chat completions, whole or as SSE chunks, with
logprobs, usage and tool calls as OpenAI writes them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.server.async_engine import EngineDeadError, RequestFailed
from pagedllm.server.protocol import (
    error_body,
)
from pagedllm.server.reasoning import ReasoningReader
from pagedllm.server.streams import merge_streams
from pagedllm.server.structured import OutputConstraint, ToolCallReader
from pagedllm.text.reasoning import prompt_state


class Api(Protocol):
    """What an answer's shape reads of the endpoint logic (server/api.py's Api, which builds the
    formats: a Protocol here keeps the import one way)."""

    model_name: str
    processor: Any  # the input processor: its tokenizer decodes token texts
    reasoning: Any  # the reasoning parser's setting (server/reasoning.py), or None
    options: Any  # server/answer_options.py's AnswerOptions

logger = logging.getLogger(__name__)

# Characters that JSON leaves raw but that line readers built on str.splitlines (httpx's
# iter_lines among them) take for line ends: escaped, so one event's data is always one line.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict) -> str:
    """payload as the data of one SSE event: UTF-8 kept, on one line whatever the text holds."""
    return json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)


def sse(payload: dict) -> str:
    return f"data: {sse_json(payload)}\n\n"


def _prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict | None] | None:
    """RequestOutput.prompt_logprobs as vLLM's API shows them: per prompt token (the first None),
    token id -> {logprob, rank, decoded_token}."""
    if entries is None:
        return None
    return [None if entry is None else {str(tid): _logprob_json(lp) for tid, lp in entry.items()}
            for entry in entries]


def _logprob_json(lp: Logprob) -> dict:
    return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}


# A logprob of -inf (a token masked out: allowed_token_ids, logit_bias -100) is no JSON number;
# vLLM and OpenAI write this floor instead.
LOGPROB_FLOOR = -9999.0


def listed_logprobs(entry: dict[int, Logprob], count: int | None) -> list[tuple[int, Logprob]]:
    """The first count of a token's logprobs as vLLM's API lists them: the scored (chosen) token
    first, then the others by rank (the output processor's order); count None: all of them."""
    items = list(entry.items())
    return items if count is None else items[:count]


def top_count(requested: int | None) -> int | None:
    """How many alternatives a request's logprobs/top_logprobs asks for: -1 (vLLM's whole
    vocabulary) is all there are."""
    return None if requested == -1 else (requested or 0)


class Format:
    """Shared by both endpoints: choice bookkeeping, usage and the streaming loop. One per
    response."""

    object_full = ""
    object_chunk = ""

    def __init__(self, api: Api, body, prompt_tokens_details: bool | None = None) -> None:
        """prompt_tokens_details: whether usage counts the cached prompt tokens (None: as the
        server's --enable-prompt-tokens-details says)."""
        self.api = api
        self.body = body
        self.n = body.n
        as_ids = body.return_tokens_as_token_ids
        self.tokens_as_ids = api.options.return_tokens_as_token_ids if as_ids is None else as_ids
        self.return_token_ids = body.return_token_ids
        # The name the request asked for (a LoRA adapter's, checked by the endpoint), as vLLM
        # answers; the base model's name where the request left it out.
        self.model = body.model or api.model_name
        self.prompt_tokens_details = (api.options.prompt_tokens_details if prompt_tokens_details is None
                                      else prompt_tokens_details)

    def token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        """How logprobs name a token: its text, or "token_id:N" if the body asks (vLLM's
        return_tokens_as_token_ids: text pieces can be ambiguous, ids are not)."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        if lp is not None:
            return lp.decoded_token
        return self.api.processor.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, prompts, completion_tokens: int, cached_tokens: int) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens} if self.prompt_tokens_details
                else None}

    def full(self, response_id: str, finals: list[RequestOutput], prompts) -> dict:
        choices, generated = [], 0
        for i, final in enumerate(finals):
            for out in final.outputs:
                choices.append(self.full_choice(i * self.n + out.index, out, prompts[i], final))
                generated += len(out.token_ids)
        response = {"id": response_id, "object": self.object_full, "created": int(time.time()),
                    "model": self.model, "choices": choices,
                    "usage": self.usage(prompts, generated, sum(f.num_cached_tokens for f in finals))}
        return self.finish_response(response, finals)

    def finish_response(self, response: dict, finals: list[RequestOutput]) -> dict:
        return response

    async def stream(self, response_id: str, streams, prompts) -> AsyncIterator[str]:
        """Server-sent events from DELTA outputs: each holds only what is new."""
        created = int(time.time())
        generated: dict[int, int] = {}  # tokens sent per choice
        cached: dict[int, int] = {}  # prefix-cache hits per prompt
        prompt_logprobs: dict[int, PromptLogprobs] = {}  # per prompt, from its first output
        options = self.body.stream_options
        force = self.api.options.force_include_usage  # usage on every chunk and at the end
        include_usage = force or bool(options and options.include_usage)
        continuous = force or (include_usage and options.continuous_usage_stats)

        def chunk(choices: list[dict], **fields) -> str:
            body = {"id": response_id, "object": self.object_chunk, "created": created,
                    "model": self.model, "choices": choices, **fields}
            if continuous:
                body["usage"] = self.usage(prompts, sum(generated.values()), sum(cached.values()))
            return sse(body)

        try:
            for first in self.opening_chunks(len(prompts)):
                yield chunk(first, **self.opening_fields(prompts))
            async for i, output in merge_streams(streams):
                cached[i] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                choices = []
                for out in output.outputs:
                    index = i * self.n + out.index
                    first = index not in generated
                    generated[index] = generated.get(index, 0) + len(out.token_ids)
                    choices.append(self.delta_choice(index, out, prompts[i], first,
                                                     prompt_logprobs.get(i)))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield sse({"id": response_id, "object": self.object_chunk, "created": created,
                            "model": self.model, "choices": [],
                            "usage": self.usage(prompts, sum(generated.values()), sum(cached.values()))})
        except (RequestFailed, EngineDeadError) as exc:
            yield sse(error_body(str(exc), "server_error", code=500))
        except asyncio.CancelledError:  # the server stopped it (its shutdown grace ran out)
            yield sse(error_body("the server is shutting down and cut this stream; retry it",
                                  "service_unavailable", code=503))
            raise
        except Exception:  # the 200 is sent already: the client can only hear it in the stream
            logger.exception("streaming response %s failed", response_id)
            yield sse(error_body("internal server error", "server_error", code=500))
        yield "data: [DONE]\n\n"

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        return []

    def opening_fields(self, prompts) -> dict:
        """Top-level fields of the first opening chunk (vLLM's prompt_token_ids)."""
        return {}

    def token_ids_fields(self, out: CompletionOutput, prompt=None, whole: bool = False) -> dict:
        """vLLM's return_token_ids fields of a choice: its token ids (and the prompt's, given
        prompt). Not asked for, a whole answer has them null (vLLM's shape: clients read
        choice.token_ids), a stream's chunks leave them out."""
        if not self.return_token_ids:
            if not whole:
                return {}
            return {**({} if prompt is None else {"prompt_token_ids": None}), "token_ids": None}
        fields = {} if prompt is None else {"prompt_token_ids": list(prompt[1])}
        return {**fields, "token_ids": list(out.token_ids)}

    def full_choice(self, index: int, out: CompletionOutput, prompt, final: RequestOutput) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, out: CompletionOutput, prompt, first: bool,
                     prompt_logprobs: PromptLogprobs | None) -> dict:
        """A chunk's choice from a DELTA output; first: this choice's first chunk."""
        raise NotImplementedError


class CompletionFormat(Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, api: Api, body) -> None:
        super().__init__(api, body)
        self.chars_sent: dict[int, int] = {}  # per choice, for the logprobs' text offsets

    def full_choice(self, index, out, prompt, final) -> dict:
        echo = self.body.echo
        text = self._echo_text(prompt) + out.text if echo else out.text
        logprobs = self._logprobs(out, final.prompt_logprobs if echo else None, prompt[1], 0)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "prompt_logprobs": _prompt_logprobs_json(final.prompt_logprobs)
                if self.body.prompt_logprobs is not None else None,
                **self.token_ids_fields(out, prompt, whole=True)}

    def delta_choice(self, index, out, prompt, first, prompt_logprobs) -> dict:
        echo = first and self.body.echo
        text = self._echo_text(prompt) + out.text if echo else out.text
        logprobs = self._logprobs(out, prompt_logprobs if echo else None, prompt[1],
                                  self.chars_sent.get(index, 0))
        self.chars_sent[index] = self.chars_sent.get(index, 0) + len(text)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                **self.token_ids_fields(out, prompt if first else None)}

    def _echo_text(self, prompt) -> str:
        text, token_ids = prompt
        if text is None:  # given as token ids
            text = self.api.processor.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text

    def _logprobs(self, out: CompletionOutput, prompt_entries: PromptLogprobs | None,
                  prompt_ids: list[int], offset: int) -> dict | None:
        """OpenAI's legacy logprobs: tokens, their logprobs, the top ones and text offsets; with
        echo, the prompt's tokens first (the first has no logprob: null)."""
        if out.logprobs is None:
            return None
        tokens, token_logprobs, tops = [], [], []
        # The chosen token and logprobs alternatives: logprobs + 1 entries at most (vLLM's and
        # OpenAI's rule), the chosen one first, so logprobs=0 lists the chosen token alone.
        top_n = top_count(self.body.logprobs)
        count = None if top_n is None or self.body.logprob_token_ids else top_n + 1

        def add(token_id: int, entry: dict[int, Logprob] | None) -> None:
            if entry is None:
                tokens.append(self.token_text(token_id))
                token_logprobs.append(None)
                tops.append(None)
                return
            chosen = entry[token_id]
            tokens.append(self.token_text(token_id, chosen))
            token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR))
            tops.append({self.token_text(tid, lp): max(lp.logprob, LOGPROB_FLOOR)
                         for tid, lp in listed_logprobs(entry, count)})

        for token_id, entry in zip(prompt_ids if prompt_entries is not None else (), prompt_entries or ()):
            add(token_id, entry)
        for token_id, entry in zip(out.token_ids, out.logprobs):
            add(token_id, entry)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def _echo_text(body, messages) -> str:
    """vLLM's chat echo: the last message's text, where the answer continues it (an assistant's
    message, or any message when no generation prompt opens a new turn); else nothing."""
    if not body.echo or not messages:
        return ""
    last = messages[-1]
    return last.text() if last.role == "assistant" or not body.add_generation_prompt else ""


class ChatFormat(Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, api: Api, body, constraint: OutputConstraint,
                 prompt_tokens_details: bool | None = None) -> None:
        super().__init__(api, body, prompt_tokens_details)
        self.constraint = constraint
        self._readers: dict[int, ToolCallReader | ReasoningReader | None] = {}  # by choice index
        conversations = body.messages if body.messages and isinstance(body.messages[0], list) \
            else [body.messages]  # a batch's, or the one conversation
        self.echoes = [_echo_text(body, messages) for messages in conversations]

    def _reader(self, index: int, prompt) -> ToolCallReader | ReasoningReader | None:
        """The choice's reader: of reasoning (with --reasoning-parser; where the answer starts
        depends on the prompt), then of tool calls; None: its text is all content."""
        if index not in self._readers:
            parser = self.constraint.new_parser()
            reader = parser and ToolCallReader(self.constraint, parser)
            fmt = self.api.reasoning
            if fmt is not None:
                text, token_ids = prompt
                if text is None:
                    text = self.api.processor.tokenizer.decode(token_ids, skip_special_tokens=False)
                reader = ReasoningReader(fmt, prompt_state(fmt, text), reader)
            self._readers[index] = reader
        return self._readers[index]

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        # a stream is one conversation: its echo (or nothing) opens each choice's content
        return [[{"index": j, "delta": {"role": "assistant", "content": self.echoes[0]}, "logprobs": None,
                  "finish_reason": None} for j in range(self.n)]]

    def opening_fields(self, prompts) -> dict:
        return {"prompt_token_ids": list(prompts[0][1])} if self.return_token_ids else {}

    def full_choice(self, index, out, prompt, final) -> dict:
        reader = self._reader(index, prompt)
        if reader is None:
            message, finish_reason = {"role": "assistant", "content": out.text}, out.finish_reason
        else:
            message, finish_reason = reader.message(out.text, out.finish_reason)
        echo = self.echoes[index // self.n]
        if echo:
            message["content"] = echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": self._logprobs(out),
                "finish_reason": finish_reason, "stop_reason": out.stop_reason,
                **self.token_ids_fields(out, whole=True)}

    def finish_response(self, response: dict, finals: list[RequestOutput]) -> dict:
        response["prompt_logprobs"] = _prompt_logprobs_json(finals[0].prompt_logprobs) \
            if self.body.prompt_logprobs is not None else None
        if not self.return_token_ids:
            response["prompt_token_ids"] = None
        else:  # one conversation: on the answer (vLLM's); a batch's: per choice
            if len(finals) == 1:
                response["prompt_token_ids"] = list(finals[0].prompt_token_ids)
            else:
                for choice in response["choices"]:
                    choice["prompt_token_ids"] = list(finals[choice["index"] // self.n].prompt_token_ids)
        return response

    def delta_choice(self, index, out, prompt, first, prompt_logprobs) -> dict:
        reader = self._reader(index, prompt)
        if reader is None:
            fields, finish_reason = {"content": out.text} if out.text else {}, out.finish_reason
        else:
            fields, finish_reason = reader.delta(out.text, out.finish_reason)
        return {"index": index, "delta": fields, "logprobs": self._logprobs(out),
                "finish_reason": finish_reason, **self.token_ids_fields(out)}

    def _logprobs(self, out: CompletionOutput) -> dict | None:
        if out.logprobs is None:
            return None
        # top_logprobs entries, the chosen token first (vLLM's list: with k, the chosen token
        # and the k - 1 best others).
        count = None if self.body.logprob_token_ids else top_count(self.body.top_logprobs)
        content = []
        for token_id, entry in zip(out.token_ids, out.logprobs):
            content.append({**self._token_json(token_id, entry[token_id]),
                            "top_logprobs": [self._token_json(tid, lp)
                                             for tid, lp in listed_logprobs(entry, count)]})
        return {"content": content}

    def _token_json(self, token_id: int, lp: Logprob) -> dict:
        text = self.token_text(token_id, lp)
        return {"token": text, "logprob": max(lp.logprob, LOGPROB_FLOOR), "bytes": list(text.encode())}
