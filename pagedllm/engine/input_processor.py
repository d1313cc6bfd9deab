"""The input processor: the one owner of prompt validation and tokenization.

The offline LLM, LLMEngine and the server all turn what a user sent into engine-core requests
here: a prompt as text, token ids or a dict (or a chat conversation, rendered by the model's
chat template), checked once, each kind of problem with one message, and tokenized. What comes
out is an EngineCoreRequest: plain data, ready to cross into the core, in this process or
another. Bad input raises InvalidInput, a ValueError naming the request field at fault.

It also owns what a request leaves unset: the model's sampling defaults (generation_config.json,
pagedllm.text.generation_defaults) fill the fields a caller does not give, and every token id a
request names (prompt, stop_token_ids, logit_bias, allowed_token_ids) is checked against the
vocabulary here, once, with all the bad ones named together.

A request constrained to a grammar (SamplingParams.structured_outputs) has it compiled here,
bounded in time, so a grammar that cannot compile is the caller's error before anything runs
(the compile is cached: the core finds it done). Tools given to a chat go into the chat
template, or, for a template with no place for them, into the system message
(pagedllm.structured.tools).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import cached_property

from pagedllm.core.priority import check_priority
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams, PoolingSetup
from pagedllm.sampling_bounds import (
    LIST_BOUNDS,
    MAX_LOGPROBS,
    WHOLE_VOCABULARY,
    check_logprob_counts,
    logprobs_cap,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.spec import GrammarSpec
from pagedllm.structured.tool_parsers import parser_for_template
from pagedllm.structured.tools import (
    Tool,
    call_arguments_as_objects,
    messages_with_tools_prompt,
    template_has_tools,
)
from pagedllm.text.chat_template import (
    MAX_RENDER_CHARS,
    TemplateTimeout,
    TemplateTooLong,
    check_chat_template,
    content_spans,
    message_texts,
)
from pagedllm.text.score_prompt import score_prompt
from pagedllm.text.tokenizer import Tokenizer

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
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 sampling_defaults: dict | None = None,
                 grammar_compiler: GrammarCompiler | None = None,
                 chat_template: str | None = None, pooling: PoolingSetup | None = None,
                 scheduling_policy: str = "fcfs", max_logprobs: int = MAX_LOGPROBS) -> None:
        """chat_template: the template every chat renders with unless a call names another (the
        server's --chat-template); None: the model's. pooling: a pooling engine's setup (None: the
        engine generates tokens). scheduling_policy: the engine's (a request's priority must be
        one it runs). max_logprobs: the engine's (-1: the whole vocabulary)."""
        # Checked at start: either would make every request fail later as if its prompt were bad.
        if tokenizer.vocab_size == 0:
            raise ValueError("the model's tokenizer has no tokens: its tokenizer.json (or GGUF "
                             "tokenizer) is empty")
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the model's tokenizer has {tokenizer.vocab_size} tokens but its "
                             f"vocabulary (the embedding's rows) is {vocab_size}: ids from {vocab_size} "
                             "on would have no embedding")
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.scheduling_policy = scheduling_policy
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        # The most logprobs alternatives a request may ask for (sampling_bounds.logprobs_cap).
        self.logprobs_cap = logprobs_cap(max_logprobs, vocab_size)
        # The model's defaults for SamplingParams fields a request leaves unset.
        self.sampling_defaults: dict = dict(sampling_defaults or {})
        # Free to make (it builds its tokenizer view on the first grammar); shared with a core
        # in the same process, which then finds every grammar compiled.
        self.grammar_compiler = grammar_compiler or GrammarCompiler(tokenizer)
        # Tokenizing holds the GIL (in the server: the event loop); a 4 MiB prompt takes seconds.
        # No text longer than this can fit in max_model_len tokens, so it is refused untokenized.
        self.max_prompt_chars = max_model_len * _longest_token_chars(tokenizer)
        template = chat_template or tokenizer.chat_template
        if template is not None:  # a broken template stops start-up, in one line
            check_chat_template(
                template, lambda messages: tokenizer.apply_chat_template(messages, chat_template=template),
                "the chat template (--chat-template)" if chat_template else "the model's chat template")

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams' own defaults under the model's (what a request that sets nothing gets)."""
        return SamplingParams(**self.sampling_defaults)

    def process(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                *, arrival_time: float | None = None, cache_salt: str | None = None,
                max_tokens_must_fit: bool = False, lora_request: LoRARequest | None = None,
                add_special_tokens: bool = True, priority: int = 0,
                truncation: PromptTruncation | None = None) -> tuple[str | None, EngineCoreRequest]:
        """The prompt's text (None if given as ids only) and the core request.

        params None: default_sampling_params(). max_tokens_must_fit (OpenAI's rule, the
        server's): prompt + max_tokens must fit in max_model_len, and max_tokens=None means all
        the room left, or the model's max_new_tokens (generation_config.json) if that is less, as
        vLLM does. Otherwise (vLLM's offline rule) a request just stops at max_model_len.
        add_special_tokens: whether a text prompt gets the BOS/EOS its tokenizer adds.
        priority: lower first, under --scheduling-policy priority (pagedllm.core.priority).
        truncation: the prompt's tokens cut to at most that many before any check (vLLM's
        truncate_prompt_tokens); a cut prompt has no text (its text no longer matches)."""
        if self.pooling is not None:
            raise InvalidInput("this model is served with --runner pooling: it returns embeddings and "
                               "scores (/v1/embeddings, /v1/rerank, /score), not generated text", "model")
        try:
            check_priority(self.scheduling_policy, priority)
        except ValueError as exc:
            raise InvalidInput(str(exc), param="priority") from None
        params = params or self.default_sampling_params()
        text, token_ids = self.tokenize(prompt, room_for_output=max_tokens_must_fit,
                                        add_special_tokens=add_special_tokens, truncation=truncation)
        self._check_sampling_token_ids(params)
        params = self._resolve_logprob_counts(params)
        if params.top_k >= self.vocab_size:  # every token: the same as no top-k, and cheaper
            params = dataclasses.replace(params, top_k=-1)
        self.check_grammar(params.structured_outputs)
        if max_tokens_must_fit:
            params = self._fit_max_tokens(params, len(token_ids))
        request = EngineCoreRequest(
            request_id, token_ids, params, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt, bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
            lora=lora_request, priority=priority)
        return text, request

    def pooling_params(self, task: str = "embed", dimensions: int | None = None,
                       normalize: bool | None = None) -> PoolingParams:
        """A pooling request's params, checked against the engine (normalize None: the engine's
        default; a score's labels: the engine's score tokens). InvalidInput naming the field."""
        setup = self.pooling
        if setup is None:
            raise InvalidInput("this model is served for generation: embeddings and scores need an "
                               "engine started with --runner pooling (or --task embed|score)", "model")
        # A classifier scores with its head; a causal LM, with its label tokens' logits.
        labels = self._score_label_ids(setup) if task == "score" and not setup.num_labels else ()
        if task == "reward" and not setup.num_labels:
            raise InvalidInput("rewards come from a reward model's head: this model is a causal LM, "
                               "not a *ForSequenceClassification checkpoint", "model")
        try:
            params = PoolingParams(task, dimensions, setup.normalize if normalize is None else normalize,
                                   labels)
            params.check_fits(setup.hidden_size, self.vocab_size)
        except ValueError as exc:
            raise InvalidInput(str(exc), str(exc).split(" ", 1)[0]) from None
        return params

    def _score_label_ids(self, setup: PoolingSetup) -> tuple[int, ...]:
        ids = []
        for label in setup.score_tokens:
            tokens = self.tokenizer.encode(label, add_special_tokens=False)
            if len(tokens) != 1:
                raise InvalidInput(f"score label {label!r} (--score-tokens) is {len(tokens)} tokens to "
                                   "this model's tokenizer; a label must be one token", "model")
            ids.append(tokens[0])
        return tuple(ids)

    def score_input(self, query: str, document: str, instruction: str | None = None) -> dict:
        """The reranker's prompt for one pair (pagedllm.text.score_prompt), tokenized with the
        user's texts plain: {"prompt": text, "prompt_token_ids": ids}."""
        text, spans = score_prompt(query, document, instruction)
        return {"prompt": text, "prompt_token_ids": self.encode(text, "documents", plain_spans=spans)}

    def process_pooling(self, request_id: str, prompt: PromptInput, pooling: PoolingParams, *,
                        arrival_time: float | None = None, cache_salt: str | None = None,
                        add_special_tokens: bool = True) -> tuple[str | None, EngineCoreRequest]:
        """A pooling request (params from pooling_params): the prompt's text and the core
        request, which samples nothing (one token of room is all its SamplingParams ask)."""
        if self.pooling is None:
            self.pooling_params()  # raises: a generation engine
        text, token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        request = EngineCoreRequest(
            request_id, token_ids, SamplingParams(max_tokens=1, temperature=0.0),
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt, pooling=pooling)
        return text, request

    def tokenize(self, prompt: PromptInput, room_for_output: bool = False, add_special_tokens: bool = True,
                 truncation: PromptTruncation | None = None) -> tuple[str | None, list[int]]:
        """The checked token ids of one prompt (and its text, if it has one and it was not cut)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"], room_for_output, add_special_tokens, truncation)
            else:
                raise InvalidInput("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if not prompt:
                raise InvalidInput(_EMPTY)
            text, token_ids = prompt, self.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, prompt
        else:
            raise InvalidInput(f"a prompt must be a string, a list of token ids or a dict; got "
                               f"{type(prompt).__name__}")
        if truncation is not None:
            kept = truncation.cut(token_ids, self.max_model_len)
            text, token_ids = (text, token_ids) if len(kept) == len(token_ids) else (None, kept)
        self._check_token_ids(token_ids, room_for_output)
        return text, list(token_ids)

    def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True,
               plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of text, refused untokenized if it is too long to fit any context
        (plain_spans: Tokenizer.encode's)."""
        self._check_text_length(len(text), param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, plain_spans=plain_spans)

    def check_request_size(self, body, max_prompts: int) -> None:
        """Cheap bounds on a decoded request body (the JSON object, before the schema): InvalidInput
        naming the field when it is past one; what is not shaped as expected is left to the schema.

        A 4 MiB body holds 250,000 chat messages or 1.9 million token ids: validating that with the
        schema, rendering it through a chat template or tokenizing it takes seconds of one core (in
        the server, of the event loop every stream shares) only to refuse it as too long. Here a
        list's length is read before its items, and items are measured only up to the bound, so
        the time is proportional to what is accepted. Each bound follows from the context, so
        nothing a request could use is refused: at most max_model_len messages (each takes a
        token) and max_prompt_chars characters of message text; per prompt, max_prompt_chars
        characters or max_model_len token ids; at most max_prompts prompts."""
        if not isinstance(body, dict):
            return
        self._check_sampling_lists_size(body)
        messages, prompt = body.get("messages"), body.get("prompt")
        if isinstance(messages, list):
            self._check_messages_size(messages)
        if isinstance(prompt, str):
            self._check_text_length(len(prompt), "prompt")
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):  # one prompt of ids
            self._check_prompt_length(len(prompt))
        elif isinstance(prompt, list):
            if len(prompt) > max_prompts:
                raise InvalidInput(f"prompt lists {len(prompt)} prompts; at most {max_prompts} are "
                                   "accepted in one request")
            for item in prompt:
                if isinstance(item, str):
                    self._check_text_length(len(item), "prompt")
                elif isinstance(item, list):
                    self._check_prompt_length(len(item))

    def _check_sampling_lists_size(self, body: dict) -> None:
        """The sampling fields' lists and dicts (logit_bias, allowed_token_ids, ...) past
        pagedllm.sampling_bounds' bounds: a 0.6 MB logit_bias is refused here, by its length,
        before the schema parses it on the server's event loop."""
        for name, limit in LIST_BOUNDS.items():
            value = body.get(name)
            if isinstance(value, (list, dict)) and len(value) > limit:
                raise InvalidInput(f"{name} must have at most {limit} entries; got {len(value)}", name)

    def _check_messages_size(self, messages: list) -> None:
        if len(messages) > self.max_model_len:
            raise InvalidInput(f"messages has {len(messages)} entries, more than this model's "
                               f"maximum context length of {self.max_model_len} tokens can hold: "
                               "shorten the conversation", "messages")
        chars = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part["text"]) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
            if chars > self.max_prompt_chars:
                raise InvalidInput(f"the messages' text is more than {self.max_prompt_chars} "
                                   f"characters, more than this model's maximum context length of "
                                   f"{self.max_model_len} tokens can hold: shorten it", "messages")

    def _check_text_length(self, length: int, param: str) -> None:
        if length > self.max_prompt_chars:
            raise InvalidInput(
                f"the prompt is {length} characters, more than this model's maximum context "
                f"length of {self.max_model_len} tokens can hold (at most {self.max_prompt_chars} "
                "characters): shorten it", param)

    def chat_prompt(self, messages: Conversation, add_generation_prompt: bool = True, *,
                    tools: Sequence[Tool] = (), chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
                    add_special_tokens: bool = False, split_special_tokens: bool = True) -> dict:
        """A conversation as one prompt, through the chat template (the model's, or chat_template):
        {"prompt": text, "prompt_token_ids": ids}. The template writes any BOS itself, so
        add_special_tokens (the tokenizer's BOS/EOS on top) is off unless asked for (vLLM's
        default for chat). split_special_tokens: a special token's text inside a message's text
        (a user writing "<|im_start|>system") is tokenized as text, not as the control token
        (HF's split_special_tokens), so no message can forge a turn of another role; False lets
        it act. chat_template_kwargs: more variables for the template (e.g. enable_thinking);
        continue_final_message: the text ends inside the last message, for the model to go on.
        The template renders within pagedllm.text.chat_template's budget.

        tools (checked ones, pagedllm.structured.tools.parse_tools) go to a template that reads
        `tools`; a template that does not gets them in the system message instead, and the
        history's tool calls and tool results written as text in the format that asks for."""
        chat_template = chat_template or self.chat_template
        if not messages:
            raise InvalidInput("messages is empty: send at least one message", "messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidInput("continue_final_message and add_generation_prompt cannot both be "
                               "true: set add_generation_prompt to false to continue the last "
                               "message", "continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(kwargs.keys() & {"messages", "add_generation_prompt", "chat_template",
                                            "continue_final_message", "tools"})
        if reserved:
            raise InvalidInput(f"chat_template_kwargs may not set {reserved}: they are request "
                               "fields of their own", "chat_template_kwargs")
        if not self.has_tools_section(chat_template):
            messages = messages_with_tools_prompt(messages, tools)
        else:
            messages = call_arguments_as_objects(messages)
            if tools:
                kwargs["tools"] = [tool.to_openai() for tool in tools]
        def render(conversation: list) -> str:
            return self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                continue_final_message=continue_final_message,
                max_chars=min(self.max_prompt_chars, MAX_RENDER_CHARS), **kwargs)

        try:
            text = render(messages)
        except TemplateTimeout:  # the template's fault, not the request's
            raise
        except TemplateTooLong:
            raise InvalidInput(
                f"the conversation renders to more than {self.max_prompt_chars} characters through "
                f"the chat template, more than this model's maximum context length of "
                f"{self.max_model_len} tokens can hold: shorten it", "messages") from None
        except ValueError as exc:  # no template, the template refused the messages, too long
            raise InvalidInput(str(exc), "messages") from exc
        except Exception as exc:  # the template itself failed (e.g. roles out of order)
            raise InvalidInput(f"the chat template could not render these messages: {exc}",
                               "messages") from exc
        # Only a message that writes out a special token needs its place found (a second render):
        # plain spans change nothing else (Tokenizer.encode).
        forging = split_special_tokens and any(
            isinstance(part, str) and self.tokenizer.has_special_text(part)
            for message in messages for part in message_texts(message))
        plain = content_spans(text, messages, render) if forging else ()
        return {"prompt": text, "prompt_token_ids": self.encode(
            text, "messages", add_special_tokens=add_special_tokens, plain_spans=plain)}

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens written out), after the vocabulary check."""
        self.check_token_ids(token_ids, "tokens", "tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def has_tools_section(self, chat_template: str | None = None) -> bool:
        """Whether the chat template (the model's, or the one given) has a place for tools; if
        not, chat_prompt puts them in the system message."""
        if chat_template is None:
            return self._model_template_has_tools
        return template_has_tools(chat_template)

    @cached_property
    def _model_template_has_tools(self) -> bool:
        return template_has_tools(self.tokenizer.chat_template)

    def tool_call_format(self, chat_template: str | None = None) -> str:
        """How the model writes tool calls under this template (tool_parsers.make_parser): the
        template's format, or Hermes', which the fallback tools prompt asks for."""
        if not self.has_tools_section(chat_template):
            return "hermes"
        return parser_for_template(chat_template or self.tokenizer.chat_template)

    def check_grammar(self, spec: GrammarSpec | None) -> None:
        """Compile a request's grammar, if it has one (cached; waits compile_timeout_s at
        most): InvalidInput with the library's message if it does not compile in time."""
        if spec is None:
            return
        try:
            self.grammar_compiler.compile(spec)
        except ValueError as exc:  # GrammarError, or text llguidance cannot take
            raise InvalidInput(str(exc), "structured_outputs") from None

    # -- checks ---------------------------------------------------------------------------------
    def check_token_ids(self, token_ids, param: str, what: str) -> None:
        """InvalidInput (naming param) unless every id is an integer in the vocabulary; the
        message names the bad ones, all of them up to a screenful."""
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            shown = f"{bad[:_MAX_SHOWN]} and {len(bad) - _MAX_SHOWN} more" if len(bad) > _MAX_SHOWN else bad
            raise InvalidInput(f"{what} must be integers in [0, {vocab}) (the vocabulary); "
                               f"out of vocabulary: {shown}", param)

    def _check_token_ids(self, token_ids, room_for_output: bool) -> None:
        if len(token_ids) == 0:
            raise InvalidInput(_EMPTY)
        self._check_prompt_length(len(token_ids), room_for_output)  # before the per-id look
        self.check_token_ids(token_ids, "prompt", "prompt token ids")

    def _check_prompt_length(self, num_tokens: int, room_for_output: bool = False) -> None:
        limit = self.max_model_len - 1 if room_for_output else self.max_model_len
        if num_tokens > limit:
            leaves = ", which leaves no room for a completion" if num_tokens <= self.max_model_len else ""
            raise InvalidInput(f"this model's maximum context length is {self.max_model_len} tokens "
                               f"(max_model_len) and the prompt has {num_tokens}{leaves}: "
                               "shorten it")

    def _resolve_logprob_counts(self, params: SamplingParams) -> SamplingParams:
        """params with -1 counts made the vocabulary's size, checked against the engine's cap
        (InvalidInput naming the field)."""
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs")
                 if getattr(params, name) == WHOLE_VOCABULARY}
        resolved = dataclasses.replace(params, **whole) if whole else params
        try:
            check_logprob_counts(resolved, self.max_logprobs, self.vocab_size)
        except ValueError as exc:
            name = "logprobs" if str(exc).startswith("logprobs") else "prompt_logprobs"
            asked = f" ({name}=-1: the whole vocabulary)" if name in whole else ""
            raise InvalidInput(f"{exc}{asked}", param=name) from None
        return resolved

    def _check_sampling_token_ids(self, params: SamplingParams) -> None:
        self.check_token_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias", "logit_bias keys")
        if params.allowed_token_ids is not None:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids", "allowed_token_ids")
        if params.logprob_token_ids is not None:
            self.check_token_ids(params.logprob_token_ids, "logprob_token_ids", "logprob_token_ids")

    def _bad_words_token_ids(self, bad_words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as it would appear at the start of the text and after a
        space (vLLM's rule: the spaced form only where it is one different token sequence of the
        same length, i.e. where the tokenizer folds the space into the word)."""
        sequences: list[tuple[int, ...]] = []
        for word in bad_words or ():
            bare = tuple(self.encode(word.lstrip(), "bad_words", add_special_tokens=False))
            spaced = tuple(self.encode(" " + word.lstrip(), "bad_words", add_special_tokens=False))
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return tuple(dict.fromkeys(sequences))

    def _fit_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            model_default = self.sampling_defaults.get("max_tokens")
            return dataclasses.replace(params, max_tokens=min(room, model_default or room))
        if params.max_tokens > room:
            raise InvalidInput(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {num_prompt_tokens} "
                f"input tokens ({params.max_tokens} + {num_prompt_tokens} > {self.max_model_len})",
                "max_tokens")
        return params


@dataclasses.dataclass(frozen=True)
class PromptTruncation:
    """vLLM's truncate_prompt_tokens: keep at most max_tokens of a prompt's tokens (-1: the
    context's length), the last ones (side "left", vLLM's default for generation) or the first."""

    max_tokens: int
    side: str = "left"

    def cut(self, token_ids: Sequence[int], max_model_len: int) -> Sequence[int]:
        keep = max_model_len if self.max_tokens == -1 else self.max_tokens
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[len(token_ids) - keep:] if self.side == "left" else token_ids[:keep]


_EMPTY = "the prompt is empty: give at least one character or token id"
_MAX_SHOWN = 20  # bad token ids named in one message


def _longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry (in
    byte-level and metaspace vocabularies an entry is at least as long as the text it decodes
    to). Without a vocabulary to look at, no bound."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(len(token) for token in vocab)
    except Exception:  # another kind of tokenizer: always tokenize
        return 2**40
