"""Tokenizer: from a Hugging Face folder and from GGUF metadata, chat templates, and incremental
detokenization. (The real SmolLM2 tokenizer against transformers: tests/model/test_smollm2.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, CHAT_TEMPLATE, EOS, tokenizer_backend, write_tokenizer

TEXTS = ["hello", "héllo wörld 日本 😀👍🏽", "  runs   of\n\n spaces\t", "", "code(x) {\n  y;\n}"]


@pytest.fixture
def folder(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 299]}))
    return tmp_path


@pytest.fixture
def tokenizer(folder):
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """The same tiny tokenizer, built in memory once (hypothesis reruns a test many times)."""
    return Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS})


def test_from_hf_folder(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)
    assert tokenizer.eos_token_ids == [257, 299]
    assert tokenizer.vocab_size == 258
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte


def test_special_tokens_in_text_stay_whole(tokenizer):
    ids = tokenizer.encode(f"{BOS}hi{EOS}")
    assert ids == [256, ord("h"), ord("i"), 257]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"{BOS}hi{EOS}"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages) == (
        f"{BOS}<user>hi{EOS}<assistant>yo{EOS}<assistant>")
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        f"yo{EOS}")


def test_chat_template_sources(folder):
    (folder / "chat_template.jinja").write_text("{{ messages | tojson }}")
    rendered = Tokenizer.from_hf_folder(folder).apply_chat_template([{"role": "u",
                                                                      "content": "é<b>"}])
    assert rendered == '[{"role": "u", "content": "é<b>"}]'  # no HTML escaping, no \u00e9
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"},
                               {"name": "default", "template": "plain"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_folder(folder).apply_chat_template([]) == "plain"


def test_chat_template_errors(folder):
    write_tokenizer(folder, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_folder(folder).apply_chat_template([])
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ValueError, match="user first"):
        Tokenizer.from_hf_folder(folder).apply_chat_template([{"role": "bot", "content": ""}])
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError):  # the sandbox refuses reaching into Python internals
        Tokenizer.from_hf_folder(folder).apply_chat_template([])


def test_from_gguf_metadata():
    tokens = ["a", "b", "ab", "Ġ", "Ġa", "<s>", "</s>", "<think>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b", "Ġ a"],
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 3, 4],
        "tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 6,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": "{{ bos_token }}",
    }
    tokenizer = Tokenizer.from_gguf(metadata)
    assert tokenizer.encode("ab a<think>") == [5, 2, 4, 7]
    assert tokenizer.encode("ab", add_special_tokens=False) == [2]
    assert tokenizer.decode([5, 2, 4, 7, 6]) == "ab a<think>"
    assert tokenizer.apply_chat_template([]) == "<s>"
    with pytest.raises(ValueError, match="'t5'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.model": "t5"})


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids=None, skip_special_tokens=True):
    detok = tokenizer.detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 257), max_size=30), skip=st.booleans())
def test_deltas_add_up_to_decode_for_any_ids(byte_tokenizer, ids, skip):
    tokenizer = byte_tokenizer
    deltas, rest, detok = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=skip) == detok.text
    assert not any(delta.endswith("\ufffd") for delta in deltas)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=20))
def test_valid_text_never_shows_a_broken_character(byte_tokenizer, text):
    tokenizer = byte_tokenizer
    deltas, rest, _ = stream(tokenizer, tokenizer.encode(text), prompt_ids=tokenizer.encode("p"))
    if "\ufffd" not in text:
        assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + rest == text


def metaspace_tokenizer() -> Tokenizer:
    """Sentencepiece-style: spaces become '▁' and the decoder drops the one a text starts with."""
    vocab = {piece: i for i, piece in enumerate(["▁", "h", "i", "▁hi", "▁there", "!"])}
    backend = Backend(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, {"bos_token": None, "eos_token": None})


def test_metaspace_leading_space_in_context():
    tokenizer = metaspace_tokenizer()
    ids = [3, 4, 5]  # "▁hi▁there!"
    assert tokenizer.decode(ids) == "hi there!"
    deltas, rest, _ = stream(tokenizer, ids)
    assert "".join(deltas) + rest == "hi there!"
    # After a prompt, the first generated word keeps its space, as it would in the full text.
    deltas, rest, _ = stream(tokenizer, [4, 5], prompt_ids=[3])
    assert deltas == [" there", "!"] and rest == ""
