"""The handlers behind the routes: a request checked, turned into engine requests (prompts,
sampling parameters, grammar), started, and answered whole or streamed, aborting what a
client leaves."""

from __future__ import annotations

import logging
import reprlib
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.input_processor import InvalidInput, PromptInput, PromptTruncation, prompt_list
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.server.answer_options import AnswerOptions
from pagedllm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from pagedllm.server.beam_search import ServerBeamSearch, beam_settings
from pagedllm.server.errors import short_repr
from pagedllm.server.formats import ChatFormat, CompletionFormat
from pagedllm.server.limits import InputWorkers
from pagedllm.server.logprob_counts import resolve_count
from pagedllm.server.lora_modules import LoRAModules
from pagedllm.server.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_SEQUENCES_PER_REQUEST,
    APIError,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ExtraFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    prompt_logprob_budget,
)
from pagedllm.server.reasoning import constraint_after_reasoning
from pagedllm.server.streams import close_all, collect_or_abort
from pagedllm.server.structured import read_constraint_async
from pagedllm.structured.spec import GrammarSpec
from pagedllm.structured.tools import Tool, parse_tools
from pagedllm.text.chat_template import TemplateTimeout
from pagedllm.text.reasoning import reasoning_format

logger = logging.getLogger(__name__)

class Api:
    """The endpoint logic: turn OpenAI bodies into engine requests and outputs into responses.
    Prompts are checked and tokenized by the engine's input processor, as everywhere else, in the
    input workers (templates and tokenizing never run on the event loop)."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: str | None,
                 workers: InputWorkers, reasoning_parser: str | None = None,
                 loras: LoRAModules | None = None,
                 options: AnswerOptions = AnswerOptions()) -> None:
        """loras: the LoRA adapters offered beside the base model (--enable-lora), by name;
        options: how answers are written (server/answer_options.py)."""
        self.engine = engine
        self.loras = loras
        self.options = options
        self.workers = workers
        self.model_name = model_name
        self.chat_template = chat_template  # None: the model's
        self.processor = engine.input_processor
        self.max_model_len = self.processor.max_model_len
        self.extra_fields = ExtraFields()
        # Chat answers split into reasoning and content (None: all content).
        self.reasoning = reasoning_format(reasoning_parser) if reasoning_parser else None

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedllm",
                "max_model_len": self.max_model_len}

    def model_cards(self) -> list[dict]:
        """The base model's card, then each LoRA adapter's, the base as its parent (vLLM's)."""
        adapters = [{**self.model_card(), "id": lora.lora_name, "parent": self.model_name}
                    for lora in (self.loras or ())]
        return [self.model_card(), *adapters]

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request):
        response_id = f"cmpl-{uuid.uuid4().hex}"
        self._check_common(body, response_id)
        prompts = _completion_prompts(body.prompt)
        _check_sequences(len(prompts), body.n)
        if body.use_beam_search:
            settings = beam_settings(body, self.processor.logprobs_cap)
            requests = await self.workers.run(self._process, response_id, body, prompts,
                                              self._beam_prompt_params(body.max_tokens), "prompt",
                                              add_special_tokens=body.add_special_tokens)
            return await self._beam_search(body, raw, response_id, requests, settings,
                                           CompletionFormat(self, body))
        logprobs = self._logprob_count("logprobs", body.logprobs)
        # echo with logprobs: the prompt's tokens get theirs too (vLLM's rule).
        prompt_logprobs = self._logprob_count("prompt_logprobs", body.prompt_logprobs)
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = logprobs
        constraint = await read_constraint_async(body, self.processor, self.chat_template)
        params = self._sampling_params(body, body.max_tokens, logprobs, prompt_logprobs,
                                       constraint.spec)
        requests = await self.workers.run(self._process, response_id, body, prompts, params,
                                          "prompt", add_special_tokens=body.add_special_tokens)
        return await self._respond(body, raw, response_id, requests, CompletionFormat(self, body))

    async def chat(self, body: ChatCompletionRequest, raw: Request,
                   prompt_tokens_details: bool | None = None):
        """prompt_tokens_details: whether usage counts the cached prompt tokens (None: as the
        server's flag says; the Responses API, which always reports them, asks for them)."""
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._check_common(body, response_id)
        constraint = await read_constraint_async(body, self.processor, self.chat_template)
        answer = ChatFormat(self, body, constraint, prompt_tokens_details)
        if body.use_beam_search:
            settings = beam_settings(body, self.processor.logprobs_cap)
            prompt = await self.workers.run(self._chat_prompt, body, constraint.tools)
            requests = await self.workers.run(self._process, response_id, body, [prompt],
                                              self._beam_prompt_params(_chat_max_tokens(body)), "messages")
            return await self._beam_search(body, raw, response_id, requests, settings, answer)
        requests = await self._chat_requests(body, response_id, [body.messages], constraint)
        return await self._respond(body, raw, response_id, requests, answer)

    async def chat_batch(self, body: BatchChatCompletionRequest, raw: Request):
        """vLLM's batch of conversations: each its own prompt, one answer with all the choices."""
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._check_common(body, response_id)
        if body.stream:
            raise APIError("the batch endpoint answers whole: stream is not available; send the "
                           "conversations one by one to /v1/chat/completions to stream them", param="stream")
        _check_sequences(len(body.messages), body.n)
        constraint = await read_constraint_async(body, self.processor, self.chat_template)
        requests = await self._chat_requests(body, response_id, body.messages, constraint)
        return await self._respond(body, raw, response_id, requests, ChatFormat(self, body, constraint))

    async def _chat_requests(self, body: ChatCompletionRequest, response_id: str, conversations,
                             constraint) -> list[tuple[str | None, EngineCoreRequest]]:
        """Each conversation through the template and the input processor, with the body's
        sampling parameters (its constraint continued after any reasoning its prompt opens)."""
        max_tokens = _chat_max_tokens(body)
        logprobs = (self._logprob_count("top_logprobs", body.top_logprobs) or 0) if body.logprobs else None
        prompt_logprobs = self._logprob_count("prompt_logprobs", body.prompt_logprobs)
        requests = []
        for i, messages in enumerate(conversations):
            prompt = await self.workers.run(self._chat_prompt, body, constraint.tools, messages)
            spec = constraint_after_reasoning(self.reasoning, prompt["prompt"], constraint.spec,
                                              body.thinking_token_budget)
            params = self._sampling_params(body, max_tokens, logprobs, prompt_logprobs, spec)
            if self.reasoning is not None and self.reasoning.special_tokens:
                params.skip_special_tokens = False  # the parser reads the markers (text/reasoning.py)
            requests += await self.workers.run(self._process, response_id, body, [prompt], params,
                                               "messages", first_index=i)
        return requests

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: a text's or a conversation's token ids, with the context length."""
        self._check_model(body)
        self.extra_fields.check(body, "tokenize")
        if isinstance(body, TokenizeChatRequest):
            try:
                tools = parse_tools(body.tools or [])
            except ValueError as exc:
                raise APIError(str(exc), param="tools") from exc
            token_ids = self._chat_prompt(body, tools)["prompt_token_ids"]
        else:
            try:
                token_ids = self.processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except InvalidInput as exc:
                raise APIError(str(exc), param=exc.param) from exc
        # vLLM's token_strs: vocabulary pieces ('Ġis'), not decoded text (' is').
        token_strs = self.processor.tokenizer.pieces(token_ids) if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.max_model_len, "tokens": token_ids,
                "token_strs": token_strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        self._check_model(body)
        self.extra_fields.check(body, "detokenize")
        try:
            return {"prompt": self.processor.detokenize(body.tokens)}
        except InvalidInput as exc:
            raise APIError(str(exc), param=exc.param) from exc

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest,
                     tools: Sequence[Tool] = (), conversation: list | None = None) -> dict:
        """The conversation (body's messages unless given) and tools through the chat template
        (the server's --chat-template, else the model's): {"prompt": text, "prompt_token_ids": ids}."""
        try:
            messages = [m.for_template() for m in (body.messages if conversation is None else conversation)]
            return self.processor.chat_prompt(
                messages, body.add_generation_prompt, tools=tools, chat_template=self.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens)
        except InvalidInput as exc:
            raise APIError(str(exc), param=exc.param) from exc
        except ValueError as exc:  # a content part that is not text
            raise APIError(str(exc), param="messages") from exc
        except TemplateTimeout as exc:  # the server's template is at fault, not the request
            logger.error("chat template cut by its time budget: %s", exc)
            raise APIError(f"{exc}; the server's chat template is at fault, not this request",
                           500, error_type="server_error", code="chat_template_timeout") from exc

    # -- checks --------------------------------------------------------------------------------
    def _logprob_count(self, name: str, requested: int | None) -> int | None:
        return resolve_count(name, requested, self.processor.vocab_size, self.processor.max_logprobs)

    def _check_model(self, body) -> LoRARequest | None:
        """The LoRA adapter body.model names (None: the base model); a 404 if it names neither."""
        if body.model is None or body.model == self.model_name:
            return None
        lora = self.loras.get(body.model) if self.loras is not None else None
        if lora is None:
            served = ", ".join(repr(card["id"]) for card in self.model_cards())
            raise APIError(f"model {short_repr(body.model)} does not exist; this server serves "
                           f"{served}", 404, param="model", code="model_not_found")
        return lora

    def _check_common(self, body, response_id: str) -> None:
        self._check_model(body)
        self.extra_fields.check(body, response_id)
        if body.stream_options is not None and not body.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError("prompt_logprobs is not available when streaming; leave it out or set "
                           "stream to false (echo with logprobs streams the prompt's logprobs)",
                           param="prompt_logprobs")

    def _sampling_params(self, body, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None,
                         structured_outputs: GrammarSpec | None) -> SamplingParams:
        """The body's sampling fields; one it leaves out (null) takes the model's default
        (generation_config.json, unless --generation-config none), else SamplingParams'.
        max_tokens=None stays: the input processor makes it the room left in the context."""
        given = dict(
            n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            seed=body.seed, min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=_token_id_keys(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
            logprob_token_ids=body.logprob_token_ids, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs)
        fields = {**self.processor.sampling_defaults,
                  **{name: value for name, value in given.items() if value is not None}}
        fields["max_tokens"] = max_tokens
        fields["output_kind"] = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    def _process(self, response_id: str, body, prompts, params: SamplingParams, prompt_param: str,
                 add_special_tokens: bool = True,
                 first_index: int = 0) -> list[tuple[str | None, EngineCoreRequest]]:
        """Each prompt through the input processor: checked, tokenized, max_tokens fitted; their
        request ids count from first_index."""
        lora = self._check_model(body)  # again: an unload may have come since the first look
        truncation = None if body.truncate_prompt_tokens is None else PromptTruncation(
            body.truncate_prompt_tokens, body.truncation_side or "left")
        try:
            return [self.processor.process(f"{response_id}-{i}", prompt, params,
                                           cache_salt=body.cache_salt, max_tokens_must_fit=True,
                                           add_special_tokens=add_special_tokens, lora_request=lora,
                                           priority=body.priority, truncation=truncation)
                    for i, prompt in enumerate(prompts, first_index)]
        except InvalidInput as exc:
            raise APIError(str(exc), param=prompt_param if exc.param == "prompt" else exc.param) from exc
        except ValueError as exc:  # max_tokens fitted into the room left broke a sampling rule
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    # -- running -------------------------------------------------------------------------------
    @staticmethod
    def _beam_prompt_params(max_tokens: int | None) -> SamplingParams:
        """What a beam search's prompts are checked and tokenized with: max_tokens fitted to the
        context (None: the room left)."""
        try:
            return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        except ValueError as exc:
            raise APIError(str(exc), param="max_tokens") from exc

    async def _beam_search(self, body, raw: Request, response_id: str,
                           requests: list[tuple[str | None, EngineCoreRequest]], settings, fmt):
        """Each prompt's beam search (server/beam_search.py), answered as a generation is."""
        streams = [ServerBeamSearch(self.engine, self.processor, request, text, settings).outputs()
                   for text, request in requests]
        prompts = [(text, request.prompt_token_ids) for text, request in requests]
        if body.stream:
            return StreamingResponse(fmt.stream(response_id, streams, prompts),
                                     media_type="text/event-stream")
        return fmt.full(response_id, await collect_or_abort(streams, raw), prompts)

    async def _respond(self, body, raw: Request, response_id: str,
                       requests: list[tuple[str | None, EngineCoreRequest]], fmt):
        _check_prompt_logprobs_work([request for _, request in requests], self.processor.max_logprobs)
        streams = await self._start(requests)
        prompts = [(text, request.prompt_token_ids) for text, request in requests]
        if body.stream:
            return StreamingResponse(fmt.stream(response_id, streams, prompts),
                                     media_type="text/event-stream")
        finals = await collect_or_abort(streams, raw)
        return fmt.full(response_id, finals, prompts)

    async def _start(self, requests: list[tuple[str | None, EngineCoreRequest]]) -> list[AsyncIterator]:
        streams = []
        try:
            self.engine.check_room(len(requests))  # all or none of a request's prompts
            for text, request in requests:
                streams.append(await self.engine.generate(request, text))
        except ValueError as exc:
            await close_all(streams)
            raise APIError(str(exc), param="prompt") from exc
        except QueueFullError as exc:
            await close_all(streams)
            raise APIError(str(exc), 503, code="server_overloaded") from exc
        except EngineDeadError as exc:
            await close_all(streams)
            raise APIError(str(exc), 503) from exc
        return streams


def _chat_max_tokens(body: ChatCompletionRequest) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _check_sequences(num_prompts: int, n: int) -> None:
    """A 400 for a request that would start more than MAX_SEQUENCES_PER_REQUEST sequences."""
    if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(f"{num_prompts} prompts x n={n} asks for {num_prompts * n} sequences; one "
                       f"request may ask for at most {MAX_SEQUENCES_PER_REQUEST} (prompts x n): "
                       "split it into several requests", param="n")


def _check_prompt_logprobs_work(requests: Sequence[EngineCoreRequest], max_logprobs: int) -> None:
    """A 400 for prompt logprobs past the budget of entries (prompt tokens x (k + 1), summed over
    the request's prompts) that the engine's --max-logprobs allows, before any of it runs."""
    k = requests[0].sampling_params.prompt_logprobs if requests else None
    if k is None:
        return
    num_tokens = sum(len(request.prompt_token_ids) for request in requests)
    budget = prompt_logprob_budget(max_logprobs)
    if num_tokens * (k + 1) > budget:
        raise APIError(f"prompt logprobs for {num_tokens} prompt tokens with {k} alternatives each "
                       f"would build {num_tokens * (k + 1)} entries; one request may ask for at most "
                       f"{budget} (prompt tokens x (k + 1)): ask for fewer "
                       "alternatives, or send fewer or shorter prompts", param="prompt_logprobs")


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings, keyed by the ids (the input
    processor checks their range). Keys that are no integer: a 400 naming them all."""
    if logit_bias is None:
        return None
    keys = {key: _as_int(key) for key in logit_bias}
    bad = [key for key, token_id in keys.items() if token_id is None]
    if bad:
        raise APIError(f"logit_bias keys must be token ids (integers written as strings); not "
                       f"integers: {reprlib.repr(bad)}", param="logit_bias")
    return {keys[key]: value for key, value in logit_bias.items()}


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _completion_prompts(prompt) -> list[PromptInput]:
    """OpenAI's prompt field (text, texts, token ids, lists of token ids) as a list of prompts;
    [] is one empty prompt, for the input processor to refuse. No prompt: vLLM's words."""
    if prompt is None:
        raise APIError("Either prompt or prompt_embeds must be provided and non-empty. This server "
                       "takes prompt (prompt_embeds is not supported).", param="prompt")
    prompts = prompt_list(prompt) or [prompt]
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(f"prompt may list at most {MAX_PROMPTS_PER_REQUEST} prompts; got "
                       f"{len(prompts)}", param="prompt")
    return prompts
