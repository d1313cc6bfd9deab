"""The input processor: every prompt form, and one message for each kind of problem, on the
tiny byte-level tokenizer (one token a byte)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.engine.input_processor import InputProcessor, InvalidInput, PromptTruncation, prompt_list
from pagedllm.sampling_params import SamplingParams
from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, CHAT_TEMPLATE, EOS, tokenizer_backend

VOCAB = 300
MAX_MODEL_LEN = 16


def tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> Tokenizer:
    return Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS}, chat_template)


@pytest.fixture
def processor() -> InputProcessor:
    return InputProcessor(tokenizer(), VOCAB, MAX_MODEL_LEN)


def test_every_prompt_form_becomes_the_same_core_request(processor):
    params = SamplingParams(max_tokens=3, seed=1)
    forms = ["hi", [104, 105], {"prompt": "hi"}, {"prompt_token_ids": [104, 105], "prompt": "hi"}]
    for prompt in forms:
        text, request = processor.process("r", prompt, params, arrival_time=5.0, cache_salt="s")
        assert request.prompt_token_ids == [104, 105] and request.sampling_params is params
        assert (request.request_id, request.arrival_time, request.cache_salt) == ("r", 5.0, "s")
        assert request.eos_token_ids == (257,)
        assert text == (None if isinstance(prompt, list) else "hi")
    assert processor.process("r", "hi")[1].sampling_params == SamplingParams()


def test_prompt_list_tells_one_prompt_from_many():
    assert prompt_list("a") == ["a"] and prompt_list({"prompt": "a"}) == [{"prompt": "a"}]
    assert prompt_list([1, 2]) == [[1, 2]] and prompt_list([[1], [2]]) == [[1], [2]]
    assert prompt_list(["a", "b"]) == ["a", "b"] and prompt_list([]) == []


EMPTY = "the prompt is empty: give at least one character or token id"


@pytest.mark.parametrize("prompt,message", [
    ("", EMPTY),
    ([], EMPTY),
    ({"prompt": ""}, EMPTY),
    ({"prompt_token_ids": []}, EMPTY),
    ({"text": "hi"}, "a prompt dict needs 'prompt' or 'prompt_token_ids'"),
    (3.5, "a prompt must be a string, a list of token ids or a dict; got float"),
    ([1, 300], "prompt token ids must be integers in [0, 300) (the vocabulary); out of vocabulary: [300]"),
    ([1, -1, True, "a"], "prompt token ids must be integers in [0, 300) (the vocabulary); out of "
                         "vocabulary: [-1, True, 'a']"),
    ([1] * 17, "this model's maximum context length is 16 tokens (max_model_len) and the prompt has "
               "17: shorten it"),
    ("x" * 17, "this model's maximum context length is 16 tokens (max_model_len) and the prompt has "
               "17: shorten it"),
])
def test_each_problem_has_one_message_naming_the_prompt(processor, prompt, message):
    with pytest.raises(InvalidInput) as caught:
        processor.process("r", prompt)
    assert str(caught.value) == message and caught.value.param == "prompt"


def test_text_too_long_to_fit_is_refused_before_tokenizing(processor):
    # The longest vocabulary entry is "<|bos|>" (7 characters): 16 tokens hold at most 112.
    with pytest.raises(InvalidInput, match=r"^the prompt is 113 characters, more than this model's "
                       r"maximum context length of 16 tokens can hold \(at most 112 characters\)"):
        processor.process("r", "x" * 113)


def test_stop_token_ids_out_of_vocabulary(processor):
    with pytest.raises(InvalidInput) as caught:
        processor.process("r", "hi", SamplingParams(stop_token_ids=[5, 300]))
    assert caught.value.param == "stop_token_ids"
    assert str(caught.value) == ("stop_token_ids must be integers in [0, 300) (the vocabulary); out of "
                                 "vocabulary: [300]")


def test_offline_requests_may_fill_the_context_and_stop_at_its_end(processor):
    _, request = processor.process("r", [1] * 16, SamplingParams(max_tokens=100))
    assert request.sampling_params.max_tokens == 100  # the scheduler ends it at max_model_len


def test_when_max_tokens_must_fit_it_defaults_to_the_room_left_and_may_not_exceed_it(processor):
    params = SamplingParams(max_tokens=None, min_tokens=2)
    _, request = processor.process("r", [1] * 10, params, max_tokens_must_fit=True)
    assert request.sampling_params == dataclasses.replace(params, max_tokens=6)
    assert params.max_tokens is None  # the caller's object is left alone
    with pytest.raises(InvalidInput) as caught:
        processor.process("r", [1] * 10, SamplingParams(max_tokens=7), max_tokens_must_fit=True)
    assert caught.value.param == "max_tokens"
    assert str(caught.value) == ("'max_tokens' is too large: 7. This model's maximum context length is "
                                 "16 tokens and your request has 10 input tokens (7 + 10 > 16)")
    with pytest.raises(InvalidInput, match=r"the prompt has 16, which leaves no room for a completion"):
        processor.process("r", [1] * 16, SamplingParams(max_tokens=None), max_tokens_must_fit=True)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens \\(1\\)"):
        processor.process("r", [1] * 15, params, max_tokens_must_fit=True)


def test_the_models_max_new_tokens_caps_the_room_left_when_a_request_gives_none():
    """vLLM's rule: generation_config.json's max_new_tokens is the default max_tokens, held to
    the room left; a max_tokens the request gives is its own, checked against the room."""
    processor = InputProcessor(tokenizer(), VOCAB, MAX_MODEL_LEN, sampling_defaults={"max_tokens": 4})
    for prompt_len, expected in ((10, 4), (13, 3)):  # room 6 and 3
        _, request = processor.process("r", [1] * prompt_len, SamplingParams(max_tokens=None),
                                       max_tokens_must_fit=True)
        assert request.sampling_params.max_tokens == expected
    _, request = processor.process("r", [1] * 10, SamplingParams(max_tokens=6), max_tokens_must_fit=True)
    assert request.sampling_params.max_tokens == 6


def test_truncation_keeps_the_last_or_first_tokens_before_the_length_check(processor):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context is cut to fit (-1: the
    context's length) rather than refused; a cut text prompt has no text any more."""
    left, right = PromptTruncation(4), PromptTruncation(4, "right")
    assert processor.tokenize(list(range(8)), truncation=left) == (None, [4, 5, 6, 7])
    assert processor.tokenize(list(range(8)), truncation=right) == (None, [0, 1, 2, 3])
    assert processor.tokenize("hi", truncation=left) == ("hi", [104, 105])  # short enough: as it was
    assert processor.tokenize("abcdef", truncation=left) == (None, list(b"cdef"))
    _, request = processor.process("r", list(range(40)), SamplingParams(max_tokens=None),
                                   max_tokens_must_fit=False, truncation=PromptTruncation(-1))
    assert request.prompt_token_ids == list(range(40 - MAX_MODEL_LEN, 40))
    with pytest.raises(InvalidInput, match="the prompt is empty"):
        processor.tokenize("abc", truncation=PromptTruncation(0))


def test_chat_prompts_go_through_the_template(processor):
    prompt = processor.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt["prompt"] == "<|bos|><user>hi<|eos|><assistant>"
    assert prompt["prompt_token_ids"] == [256, *b"<user>hi", 257, *b"<assistant>"]
    no_generation = processor.chat_prompt([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_generation["prompt"] == "<|bos|><user>hi<|eos|>"


@pytest.mark.parametrize("messages,message", [
    ([], "messages is empty: send at least one message"),
    ([{"role": "user", "content": "y" * 200}], "the conversation renders to more than 112 characters "
                                                "through the chat template, more than this model's "
                                                "maximum context length of 16 tokens can hold: "
                                                "shorten it"),
])
def test_chat_problems_name_the_messages(processor, messages, message):
    with pytest.raises(InvalidInput) as caught:
        processor.chat_prompt(messages)
    assert str(caught.value) == message and caught.value.param == "messages"


def test_a_model_without_a_chat_template_says_so():
    processor = InputProcessor(tokenizer(chat_template=None), VOCAB, MAX_MODEL_LEN)
    with pytest.raises(InvalidInput, match="no chat template") as caught:
        processor.chat_prompt([{"role": "user", "content": "hi"}])
    assert caught.value.param == "messages"


def test_a_template_that_fails_on_a_request_is_a_bad_request(processor):
    with pytest.raises(InvalidInput, match="the chat template") as caught:
        processor.chat_prompt([{"role": "user", "content": "hi"}],
                              chat_template="{{ messages[5]['content'] }}")
    assert caught.value.param == "messages"


def test_every_token_id_a_request_names_is_checked_against_the_vocabulary_all_bad_ones_together(processor):
    cases = [
        (SamplingParams(logit_bias={5: 1.0, 300: 2.0, 999: -1.0}), "logit_bias",
         "logit_bias keys must be integers in [0, 300) (the vocabulary); out of vocabulary: [300, 999]"),
        (SamplingParams(allowed_token_ids=[1, 301]), "allowed_token_ids",
         "allowed_token_ids must be integers in [0, 300) (the vocabulary); out of vocabulary: [301]"),
        (SamplingParams(stop_token_ids=list(range(290, 330))), "stop_token_ids",
         f"out of vocabulary: {list(range(300, 320))} and 10 more"),
    ]
    for params, param, message in cases:
        with pytest.raises(InvalidInput) as caught:
            processor.process("r", "hi", params)
        assert caught.value.param == param and str(caught.value).endswith(message)


def test_bad_words_become_token_sequences_at_the_start_and_after_a_space(processor):
    _, request = processor.process("r", "hi", SamplingParams(bad_words=["ab", " c"]))
    # The byte tokenizer keeps a space its own token: only the bare forms (vLLM's rule).
    assert request.bad_words_token_ids == ((97, 98), (99,))
    assert processor.process("r", "hi")[1].bad_words_token_ids == ()


def test_defaults_fill_what_the_caller_leaves_unset():
    processor = InputProcessor(tokenizer(), VOCAB, MAX_MODEL_LEN, sampling_defaults={"top_k": 5})
    assert processor.process("r", "hi")[1].sampling_params == SamplingParams(top_k=5)
    given = SamplingParams(temperature=0)
    assert processor.process("r", "hi", given)[1].sampling_params is given


def test_chat_options(processor):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    continued = processor.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert continued["prompt"] == "<|bos|><user>hi<|eos|><assistant>Hel"
    own = processor.chat_prompt(messages[:1], chat_template="{{ greeting }}{{ messages[0].content }}",
                                chat_template_kwargs={"greeting": "Say "}, add_special_tokens=True)
    assert own["prompt"] == "Say hi" and own["prompt_token_ids"] == list(b"Say hi")
    for kwargs, param in [(dict(continue_final_message=True), "continue_final_message"),
                          (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs")]:
        with pytest.raises(InvalidInput) as caught:
            processor.chat_prompt(messages, **kwargs)
        assert caught.value.param == param


def test_detokenize_checks_the_vocabulary_and_keeps_special_tokens(processor):
    assert processor.detokenize([256, 104, 105]) == "<|bos|>hi"
    with pytest.raises(InvalidInput) as caught:
        processor.detokenize([1, 300])
    assert caught.value.param == "tokens"


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"role": "user", "content": "x"}] * 250_000}, "messages",
     "messages has 250000 entries, more than this model's maximum context length of 16 tokens"),
    ({"messages": [{"role": "user", "content": "x" * 100}, {"role": "user", "content": [
        {"type": "text", "text": "y" * 13}]}]}, "messages", "the messages' text is more than 112 characters"),
    ({"prompt": list(range(1_900_000))}, "prompt", "maximum context length is 16 tokens (max_model_len) "
                                                   "and the prompt has 1900000"),
    ({"prompt": [[1, 2], list(range(17))]}, "prompt", "the prompt has 17"),
    ({"prompt": ["hi", "x" * 113]}, "prompt", "the prompt is 113 characters"),
    ({"prompt": "x" * 4_000_000}, "prompt", "the prompt is 4000000 characters"),
    ({"prompt": ["hi"] * 65}, "prompt", "prompt lists 65 prompts; at most 64"),
])
def test_a_raw_body_past_a_cheap_bound_is_refused_before_parsing(processor, body, param, message):
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        processor.check_request_size(body, max_prompts=64)
    assert caught.value.param == param


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}] * 16}, {"prompt": "x" * 112},
    {"prompt": list(range(16))}, {"prompt": [[1, 2], [3]] * 32}, {"prompt": ["a", "b"]}, {},
    {"messages": "not a list", "prompt": 5}, [], "text",
])
def test_bodies_within_the_bounds_are_left_to_the_schema(processor, body):
    processor.check_request_size(body, max_prompts=64)


def test_a_tokenizer_the_model_cannot_embed_is_refused_at_start():
    """Issue 32, finding 8: an empty tokenizer, or one with more tokens than the model's
    vocabulary, started and then failed every request as if its prompt were at fault."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    with pytest.raises(ValueError, match="has no tokens"):
        InputProcessor(Tokenizer(Backend(WordLevel({}, unk_token=None)), {}), VOCAB, MAX_MODEL_LEN)
    size = tokenizer().vocab_size
    with pytest.raises(ValueError, match=f"has {size} tokens but its vocabulary .* is {size - 1}"):
        InputProcessor(tokenizer(), size - 1, MAX_MODEL_LEN)
    assert InputProcessor(tokenizer(), size, MAX_MODEL_LEN).vocab_size == size
