"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers reading the
same file: tokenizer ids, incremental detokenization, and greedy continuations."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import requires_default_model
from tests.model.paged import greedy_generate

pytestmark = requires_default_model

TEXTS = [
    "Hello world",
    "  leading spaces,\n\n\ttabs   and   runs    of     spaces   ",
    "\n\n\nnewlines\r\nand CRLF\n \n",
    "héllo wörld, ünïcödé ñ, 日本語のテキスト, 中文, 한국어, Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 🤖",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567 3.14159 -42 1e-5, it's we'll I'M don't",
    "",
]


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name)


def test_config_from_gguf(default_model):
    config = default_model.config
    shape = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
    assert shape == (30, 576, 3)
    assert config.tie_word_embeddings and config.eos_token_ids == [2]
    assert config.dtype == torch.float32


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(default_model, hf_tokenizer, text):
    ours = default_model.tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text)
    assert default_model.tokenizer.decode(ours) == hf_tokenizer.decode(ours,
                                                                       skip_special_tokens=True)


def test_special_tokens_and_chat_template(default_model, hf_tokenizer):
    tokenizer = default_model.tokenizer
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.vocab_size == len(hf_tokenizer)
    messages = [{"role": "user", "content": "Hi there"}]
    assert tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization_equals_full_decode(default_model, skip_special_tokens):
    tokenizer = default_model.tokenizer
    rng = random.Random(0)
    streams = [tokenizer.encode(text) for text in TEXTS]
    # Random ids too, including lone byte tokens that split characters in invalid ways.
    streams += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(20)]
    streams += [[rng.randrange(256) for _ in range(40)] for _ in range(20)]
    for ids in streams:
        detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
        deltas = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])


def test_detokenizer_never_emits_half_a_character(default_model):
    tokenizer = default_model.tokenizer
    text = "😀 日本 🇫🇷 👨‍👩‍👧"
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer(prompt_ids=tokenizer.encode("Say: "))
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.timeout(300)  # transformers' greedy decode on the CPU: ~40 s under load
@torch.inference_mode()
def test_greedy_matches_transformers(default_model, hf_default_model):
    tokenizer = default_model.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False),
        tokenizer.encode("The three primary colors are"),
        tokenizer.encode("def fibonacci(n):\n"),
        tokenizer.encode("Once upon a time, in a small village by the sea, there lived"),
    ]
    ours = greedy_generate(default_model.model, prompts, max_new_tokens=32, block_size=4)
    for prompt, generated in zip(prompts, ours):
        expected = hf_default_model.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, top_p=None, top_k=None,
            temperature=None)[0, len(prompt):].tolist()
        # transformers stops at EOS; compare up to where it stopped.
        assert generated[:len(expected)] == expected, tokenizer.decode(expected)
