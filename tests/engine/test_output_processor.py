"""The output processor, fed core outputs by hand on the tiny byte-level tokenizer (one token a
byte, so a multi-byte character spans tokens): deltas add up to the cumulative text, stop strings
cut exactly, text that may start a stop string is held back, n outputs and logprobs."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import TokenLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, EOS, tokenizer_backend

TOKENIZER = Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS})
PROMPT = list(b"Say: ")
KINDS = list(RequestOutputKind)


def add(processor: OutputProcessor, request_id: str, params: SamplingParams) -> None:
    processor.add_request(EngineCoreRequest(request_id, PROMPT, params, (257,), 0.0), "Say: ")


def feed(processor: OutputProcessor, request_id: str, tokens: list[int], index: int = 0,
         finish_reason: str = "length", first_scheduled_time: float | None = None, **last) -> list:
    """One core output per token, the last one finishing; every RequestOutput handed out."""
    outputs = []
    for i, token in enumerate(tokens):
        end = i == len(tokens) - 1
        core = EngineCoreOutput(request_id, index, [token], finish_reason=finish_reason if end else None,
                                first_scheduled_time=first_scheduled_time, **(last if end else {}))
        outputs += processor.process_outputs([core]).request_outputs
    return outputs


def run(text: str, kind: RequestOutputKind, **params) -> list:
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams(output_kind=kind, **params))
    return feed(processor, "r", list(text.encode()))


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab é€\n😀", min_size=1, max_size=30),
       stop=st.lists(st.text(alphabet="ab é", min_size=1, max_size=3), max_size=2))
def test_deltas_add_up_to_the_cumulative_text_and_the_final_output(text, stop):
    cumulative = run(text, RequestOutputKind.CUMULATIVE, stop=stop)
    deltas = run(text, RequestOutputKind.DELTA, stop=stop)
    final = run(text, RequestOutputKind.FINAL_ONLY, stop=stop)
    assert len(final) == 1 and final[0].finished
    whole = final[0].outputs[0]
    assert cumulative[-1].outputs[0] == whole
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
    # Every cumulative step is a prefix of the final text: nothing shown is taken back. Its token
    # list is the sequence's own, handed out each step without a copy.
    assert all(whole.text.startswith(c.outputs[0].text) for c in cumulative)
    assert all(c.outputs[0].token_ids is cumulative[-1].outputs[0].token_ids for c in cumulative)
    assert all(d.outputs[0].text or d.finished for d in deltas)  # no empty deltas
    if not any(s in text for s in stop):
        assert whole.text == text and whole.finish_reason == "length"


def test_a_stop_string_cuts_the_text_exactly_and_asks_the_core_to_abort():
    for include, expected in ((False, "one "), (True, "one two")):
        processor = OutputProcessor(TOKENIZER)
        add(processor, "r", SamplingParams(stop=["two"], include_stop_str_in_output=include))
        aborts = []
        for token in b"one two three":
            result = processor.process_outputs([EngineCoreOutput("r", 0, [token])])
            aborts += result.sequences_to_abort
            if result.request_outputs and result.request_outputs[0].finished:
                final = result.request_outputs[0].outputs[0]
                break
        assert final.text == expected and final.finish_reason == "stop" and final.stop_reason == "two"
        assert final.token_ids == list(b"one two")  # the token that completed it is kept
        assert aborts == [("r", 0)]
        # The core's outputs of a step already under way are ignored.
        assert processor.process_outputs([EngineCoreOutput("r", 0, [32])]).request_outputs == []


def test_a_stop_string_on_the_token_the_core_ends_on_still_cuts_there():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams(stop=["b"], output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = feed(processor, "r", [97, 98], finish_reason="length")
    choice = out.outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("a", "stop", "b")


def test_text_that_may_start_a_stop_string_is_held_back():
    shown = [o.outputs[0].text for o in run("abcabd", RequestOutputKind.CUMULATIVE, stop=["abd!"])]
    # Three characters could begin "abd!": they are shown only once they cannot.
    assert shown == ["", "", "", "a", "ab", "abcabd"]


def test_an_incomplete_character_waits_for_its_last_byte():
    deltas = [o.outputs[0].text for o in run("é€", RequestOutputKind.DELTA)]
    assert deltas == ["é", "€"]  # none for the first byte of each


def test_finish_reasons_stop_token_and_metrics_pass_through():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    (out,) = feed(processor, "r", [104, 105, 42], finish_reason="stop", stop_reason=42,
                  num_cached_tokens=4, first_scheduled_time=1.5, num_preemptions=2)
    choice = out.outputs[0]
    assert (choice.finish_reason, choice.stop_reason, choice.text) == ("stop", 42, "hi")  # 42: no text
    assert out.prompt == "Say: " and out.prompt_token_ids == PROMPT and out.finished
    assert out.metrics.num_output_tokens == 3 and out.metrics.num_preemptions == 2
    assert out.metrics.first_scheduled_time == 1.5 and out.metrics.first_token_time is not None
    assert not processor.has_unfinished_requests()


def test_the_token_that_stops_a_sequence_gives_no_text_unless_asked():
    """vLLM's rule: the EOS or stop token id that ended a sequence stays in its token ids, but its
    text (an EOS's, shown with skip_special_tokens off) only with include_stop_str_in_output. A
    stop token id that did not stop it (a grammar completed on it before min_tokens: the core
    names no stop_reason) is text."""
    cases = [(dict(skip_special_tokens=False), 257, None, "hi"),
             (dict(skip_special_tokens=False, include_stop_str_in_output=True), 257, None, f"hi{EOS}"),
             (dict(stop_token_ids=[42]), 42, 42, "hi"),
             (dict(stop_token_ids=[42], include_stop_str_in_output=True), 42, 42, "hi*"),
             (dict(stop_token_ids=[42], min_tokens=5), 42, None, "hi*")]
    for params, last, stop_reason, text in cases:
        processor = OutputProcessor(TOKENIZER)
        add(processor, "r", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params))
        (out,) = feed(processor, "r", [104, 105, last], finish_reason="stop", stop_reason=stop_reason)
        assert (out.outputs[0].text, out.outputs[0].token_ids) == (text, [104, 105, last])
    processor = OutputProcessor(TOKENIZER)  # an EOS that does not stop (ignore_eos) is text
    add(processor, "r", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, skip_special_tokens=False,
                                       ignore_eos=True))
    (out,) = feed(processor, "r", [104, 257, 105], finish_reason="length")
    assert out.outputs[0].text == f"h{EOS}i"


def test_num_cached_tokens_comes_from_the_first_output():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams())
    result = processor.process_outputs([EngineCoreOutput("r", 0, [104], num_cached_tokens=16)])
    assert result.request_outputs[0].num_cached_tokens == 16


def test_n_outputs_finish_together_and_deltas_carry_only_news():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams(n=2, output_kind=RequestOutputKind.DELTA))
    first = processor.process_outputs([EngineCoreOutput("r", 0, [97]), EngineCoreOutput("r", 1, [98])])
    assert [(o.index, o.text) for o in first.request_outputs[0].outputs] == [(0, "a"), (1, "b")]
    ended = processor.process_outputs([EngineCoreOutput("r", 1, [99], finish_reason="length")])
    (out,) = ended.request_outputs
    assert not out.finished
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [(1, "c", "length")]
    last = processor.process_outputs([EngineCoreOutput("r", 0, [100], finish_reason="length")])
    (out,) = last.request_outputs
    assert out.finished and [(o.index, o.text) for o in out.outputs] == [(0, "d")]  # 1 said its end


def test_logprobs_become_dicts_with_decoded_tokens():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY))
    lp = TokenLogprobs(token_id=105, logprob=-0.5, rank=2, top=[(104, -0.25)])
    (out,) = processor.process_outputs(
        [EngineCoreOutput("r", 0, [105], [lp], finish_reason="length")]).request_outputs
    (entry,) = out.outputs[0].logprobs
    decoded = {t: dataclasses.astuple(v) for t, v in entry.items()}
    assert decoded == {104: (-0.25, 1, "h"), 105: (-0.5, 2, "i")}
    assert out.outputs[0].cumulative_logprob == -0.5


def test_aborted_requests_are_forgotten():
    processor = OutputProcessor(TOKENIZER)
    add(processor, "r", SamplingParams())
    assert "r" in processor and processor.abort_request("r") and not processor.abort_request("r")
    assert processor.process_outputs([EngineCoreOutput("r", 0, [104])]).request_outputs == []


def test_prompt_logprobs_come_with_the_first_delta_and_with_every_cumulative_output():
    sent = [None] + [TokenLogprobs(t, -0.5, 2, [(ord("x"), -0.1)]) for t in PROMPT[1:]]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        processor = OutputProcessor(TOKENIZER)
        add(processor, "r", SamplingParams(output_kind=kind, prompt_logprobs=1))
        first = EngineCoreOutput("r", 0, [ord("a")], prompt_logprobs=sent)
        outputs = processor.process_outputs([first]).request_outputs + feed(processor, "r", [ord("b")])
        entries = outputs[0].prompt_logprobs
        assert entries[0] is None and len(entries) == len(PROMPT)
        assert entries[1] == {ord("a"): entries[1][ord("a")], ord("x"): entries[1][ord("x")]}
        assert (entries[1][ord("a")].logprob, entries[1][ord("a")].rank) == (-0.5, 2)
        assert entries[1][ord("x")].decoded_token == "x"
        later = outputs[1].prompt_logprobs
        assert later is None if kind is RequestOutputKind.DELTA else later == entries
