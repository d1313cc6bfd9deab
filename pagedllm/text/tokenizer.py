"""Encode, decode incrementally, and render chat templates, on the `tokenizers` library.

A tokenizer comes from a Hugging Face folder (tokenizer.json) or is rebuilt from the vocabulary,
merges and special tokens a GGUF file stores as metadata: byte-level BPE here, SentencePiece in
sentencepiece_vocab.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from pagedllm.text.chat_template import MAX_RENDER_CHARS, compile_chat_template, render_chat_template
from pagedllm.text.sentencepiece_vocab import sentencepiece_from_gguf

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Control tokens that end a turn, which llama.cpp stops at whatever the file's eos id says.
_END_OF_TURN_TOKENS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>",
                                 "<end_of_turn>", "<|endoftext|>", "<EOT>"})

# How each GGUF `tokenizer.ggml.pre` splits text before byte-level BPE. Names not listed use
# GPT-2's own split, as transformers does for them (SmolLM2 says "smollm").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        # bos_token / eos_token / unk_token / pad_token as text, for chat templates.
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(special_tokens.get("eos_token"))
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no tokenizer.json in the model folder")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception for any parse failure
            raise ValueError(f"{tokenizer_file}: not a tokenizer the tokenizers library can read "
                             f"(truncated or damaged?): {str(exc).splitlines()[0][:300]}") from None
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: _token_text(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        # Every id the model ends a generation with: the model config's and the generation
        # config's (Llama 3 lists <|eot_id|> and <|eom_id|> there) join the tokenizer's EOS.
        extra_eos = [*_as_id_list(_read_json(folder / "config.json").get("eos_token_id")),
                     *_as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))]
        return cls(backend, special, _hf_chat_template(folder, config), extra_eos_token_ids=extra_eos)

    @classmethod
    def from_gguf(cls, reader_or_metadata: Any) -> Tokenizer:
        """From a gguf.GGUFReader or its metadata as a dict of plain values."""
        metadata = reader_or_metadata
        if not isinstance(metadata, dict):
            metadata = {name: f.contents() for name, f in reader_or_metadata.fields.items()}
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in _GGUF_VOCABULARIES:
            raise ValueError(
                f"cannot build a tokenizer from GGUF tokenizer model {kind!r}: supported are "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece); use the model's Hugging "
                "Face folder instead")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]

        def text_of(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None else None

        special = {"bos_token": text_of("bos_token_id"),
                   "eos_token": text_of("eos_token_id"),
                   "unk_token": text_of("unknown_token_id"),
                   "pad_token": text_of("padding_token_id")}
        backend = _GGUF_VOCABULARIES[kind](metadata)
        _add_gguf_special_tokens(backend, metadata, byte_level=kind == "gpt2")
        backend.post_processor = _bos_eos_processor(metadata, special)
        extra_eos = [metadata[k] for k in ("tokenizer.ggml.eot_token_id",
                                           "tokenizer.ggml.eom_token_id") if k in metadata]
        token_types = metadata.get("tokenizer.ggml.token_type") or []
        extra_eos += [i for i, (token, token_type) in enumerate(zip(tokens, token_types))
                      if token_type == _CONTROL and token in _END_OF_TURN_TOKENS]
        return cls(backend, special, metadata.get("tokenizer.chat_template"), extra_eos)

    def encode(self, text: str, add_special_tokens: bool = True,
               plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of text. Special tokens written in the text (like <|im_start|>) are matched
        whole, except inside plain_spans (character spans: a chat's message texts), where they
        are text like any other (HF's split_special_tokens); add_special_tokens adds the BOS/EOS
        the tokenizer is configured to add."""
        # encode_batch releases the GIL while it works (encode holds it: a long prompt tokenized
        # in a server's worker thread would still stall the event loop); same ids.
        encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        special = self._special_token_ids
        if not plain_spans or special.isdisjoint(encoding.ids):
            return encoding.ids
        ids: list[int] = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in special and start < end and any(a <= start and end <= b for a, b in plain_spans):
                ids += self._as_text.encode(text[start:end], add_special_tokens=False).ids
            else:
                ids.append(token_id)
        return ids

    def has_special_text(self, text: str) -> bool:
        """Whether text writes out a special token (which encode matches whole outside plain_spans)."""
        return any(token in text for token in self._special_token_texts)

    @cached_property
    def _special_token_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    @cached_property
    def _special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    @cached_property
    def _as_text(self) -> tokenizers.Tokenizer:
        """The same tokenizer, matching no special token in text (a copy: the setting is the
        tokenizer's, and other threads encode with the original meanwhile)."""
        copy = tokenizers.Tokenizer.from_str(self.backend.to_str())
        copy.encode_special_tokens = True
        return copy

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's own spelling of each id ('Ġis' in a byte-level BPE, '▁is' in a
        SentencePiece one), as transformers' convert_ids_to_tokens gives it; not decoded text."""
        return [self.backend.id_to_token(token_id) or "" for token_id in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, continue_final_message: bool = False, *,
        max_chars: int = MAX_RENDER_CHARS, **extra: Any
    ) -> str:
        """The prompt text for a conversation, through chat_template (default: the model's).
        It already holds any BOS the template writes, so encode it with add_special_tokens=False.
        extra: more template variables. continue_final_message: the text is cut right after the
        last message's content (the template's end-of-turn dropped), for the model to go on.
        Rendered within pagedllm.text.chat_template's budget: RENDER_TIMEOUT_S and max_chars
        (TemplateTimeout, TemplateTooLong past them).

        A template that refuses a system message (Gemma 1 and 2: "System role not supported")
        gets it folded into the first user message instead, as Gemma 3's own template does."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        compiled = compile_chat_template(template)
        # Unset special tokens stay undefined (render as ""), not the text "None".
        context = {name: text for name, text in self.special_tokens.items() if text is not None}
        context.update(extra, add_generation_prompt=add_generation_prompt)
        try:
            text = render_chat_template(compiled, max_chars=max_chars, messages=messages, **context)
        except jinja2.TemplateError as exc:
            folded = _system_folded_into_first_user(messages)
            if folded is None:
                raise ValueError(f"the chat template rejected the messages: {exc}") from None
            try:
                text = render_chat_template(compiled, max_chars=max_chars, messages=folded, **context)
            except jinja2.TemplateError:  # its complaint is about something else: report the first
                raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return _cut_after_final_message(text, messages) if continue_final_message else text


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation up to the end of the last message's content (transformers' rule
    for continue_final_message: what the template adds after it, such as the end of the turn,
    goes; trailing spaces the template trimmed from the content stay trimmed)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    at = text.rfind(final.strip())
    if at == -1:
        raise ValueError("continue_final_message is set but the chat template does not write the "
                         "last message's text as it is")
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


def _system_folded_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with a leading system message put before the first user message's text,
    a blank line between (Gemma 3's way); None if it does not start system, user with text."""
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        return None
    system, user = messages[0].get("content"), messages[1].get("content")
    if not (isinstance(system, str) and isinstance(user, str)):
        return None
    return [{**messages[1], "content": f"{system}\n\n{user}"}, *messages[2:]]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each step decodes a short window of recent tokens twice, with and without the new ones, and
    emits the difference: decoding is not per-token additive (a character may span tokens, and
    some decoders drop the space at the start of a string), but it is additive at character
    boundaries. Text ending in U+FFFD is held back, since it is usually a character whose
    remaining bytes are in the next token. The deltas, with flush(), add up to decode(ids).
    """

    # Prompt tokens kept as context, so the first generated token decodes as it would in place.
    PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _ids[_prefix_offset:_read_offset] is the context already emitted (or the prompt's).
        self._ids = list(prompt_ids or [])[-self.PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Whatever is held back, even an incomplete character (at the end of a stream)."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        delta = full[len(prefix):]
        # Only the tokens from the old read offset on are needed as the next window's context.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _byte_level_bpe_from_gguf(metadata: dict[str, Any]) -> tokenizers.Tokenizer:
    """Byte-level BPE built the way transformers builds it from the same metadata."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    alphabet = set(_bytes_to_unicode().values())
    vocab = {_byte_level_spelling(token, alphabet): i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split = _GGUF_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


_GGUF_VOCABULARIES = {"gpt2": _byte_level_bpe_from_gguf, "llama": sentencepiece_from_gguf}


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, metadata: dict[str, Any], byte_level: bool
) -> None:
    """Control tokens (and SentencePiece's unknown token) matched whole as special tokens,
    user-defined ones (like <think>) matched whole as plain text, as transformers adds them."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special_kinds = {_CONTROL} if byte_level else {_CONTROL, _UNKNOWN}
    # In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    # converter mislabel: skip it.
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind in special_kinds and (alphabet is None or set(token) <= alphabet)])
    vocab = backend.get_vocab()
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and token in vocab])


def _bos_eos_processor(metadata: dict[str, Any], special: dict[str, str | None]):
    """Adds BOS/EOS around each sequence if the file says to (tokenizer.ggml.add_*_token;
    SentencePiece files that do not say add BOS, as llama.cpp does)."""
    before, after, specials = [], [], []
    add_bos = metadata.get("tokenizer.ggml.add_bos_token",
                           metadata.get("tokenizer.ggml.model") == "llama")
    if add_bos and special["bos_token"]:
        before = [special["bos_token"]]
        specials.append((special["bos_token"], metadata["tokenizer.ggml.bos_token_id"]))
    if metadata.get("tokenizer.ggml.add_eos_token") and special["eos_token"]:
        after = [special["eos_token"]]
        specials.append((special["eos_token"], metadata["tokenizer.ggml.eos_token_id"]))
    return processors.TemplateProcessing(
        single=[*before, "$A", *after],
        pair=[*before, "$A", *after, *before, "$B:1", *after],
        special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which byte-level vocabularies are
    spelled (a space is 'Ġ', a newline 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_spelling(token: str, alphabet: set[str]) -> str:
    """GGUF files store most tokens already in the byte alphabet, but some added tokens as raw
    text; respell those so every vocabulary entry is in the alphabet the model expects."""
    if set(token) <= alphabet:
        return token
    spelling = _bytes_to_unicode()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else the tokenizer config's entry
    (a string, or a list of named templates of which we take "default")."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _token_text(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes special tokens as text or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
