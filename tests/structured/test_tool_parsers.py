"""Tool-call parsers: what they read out of Hermes, Llama 3.x JSON and gpt-oss Harmony text, that
streamed deltas in any chunking add up to the whole answer's parse, and that nothing which is not a
call is lost."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.structured.tool_parsers import (
    NamedToolParser,
    ParsedMessage,
    make_parser,
    parse_tool_calls,
    parser_for_template,
)


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(kind, text):
    return parse_tool_calls(text, make_parser(kind, counting_ids()))


def stream(kind, chunks):
    parser = make_parser(kind, counting_ids())
    return [parser.feed(chunk) for chunk in chunks] + [parser.finish()]


def calls_of(message):
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def test_hermes_content_and_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"nested": [1, {"x": "}\\""}]}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": '
            '"{\\"a\\": 1}"}\n</tool_call>\n')
    message = parse("hermes", text)
    assert message.content == "Let me check."
    assert calls_of(message) == [("get_weather", {"city": "Paris", "nested": [1, {"x": '}"'}]}),
                                 ("f", {"a": 1})]
    # The arguments are the model's own text of the object, not a re-serialization.
    assert message.tool_calls[0].arguments == '{"city": "Paris", "nested": [1, {"x": "}\\""}]}'
    assert [c.id for c in message.tool_calls] == ["call_0", "call_1"]
    assert message.tool_calls[0].to_openai() == {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": message.tool_calls[0].arguments}}


@pytest.mark.parametrize("text, content, calls", [
    ("no calls <tool_ here  \n", "no calls <tool_ here  \n", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"no_name": 1}</tool_call>', '<tool_call>{"no_name": 1}</tool_call>', []),
    ('<tool_call>{"name": "h"}</tool_call>', None, [("h", {})]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>', None, [("g", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call> Done.', " Done.", [("f", {"a": [1]})]),
    ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # no closing tag: EOS came first
    ("", "", []),
])
def test_hermes_edge_cases(text, content, calls):
    message = parse("hermes", text)
    assert message.content == content and calls_of(message) == calls


def test_a_call_cut_short_is_kept_as_far_as_it_got():
    message = parse("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1')
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"a": 1')]


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "t", "parameters": {}}',
     None, [("get_weather", {"city": "Paris"}), ("t", {})]),
    ('[{"name": "a", "parameters": {"x": 1.5}}, {"name": "b", "arguments": {"y": true}}]',
     None, [("a", {"x": 1.5}), ("b", {"y": True})]),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # an answer, not a call
    ("The answer is {}", "The answer is {}", []),
    ('  {"answer": 42}  ', '  {"answer": 42}  ', []),
    ("[1, 2]", "[1, 2]", []),
    ('{"name": "a", "parameters": {"x": 1}} and then', " and then", [("a", {"x": 1})]),
])
def test_llama3_json(text, content, calls):
    message = parse("json", text)
    assert message.content == content and calls_of(message) == calls


def test_first_delta_has_id_and_name_then_argument_fragments():
    text = '<tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>'
    deltas = stream("hermes", [text[i:i + 4] for i in range(0, len(text), 4)])
    call_deltas = [d for delta in deltas for d in delta.tool_calls]
    assert call_deltas[0].to_openai() == {"index": 0, "id": "call_0", "type": "function",
                                          "function": {"name": "f", "arguments": ""}}
    assert len(call_deltas) > 3  # the arguments arrive as the text does, not at the end
    assert all(d.id is None and d.to_openai() == {"index": 0, "function": {"arguments": d.arguments}}
               for d in call_deltas[1:])
    assert "".join(d.arguments for d in call_deltas) == '{"city": "Paris"}'


@pytest.mark.parametrize("text, content, calls", [
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     None, [("get_weather", {"city": "Paris"})]),
    ('to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}', None,
     [("get_weather", {"city": "Oslo"})]),  # the recipient in the role header; no <|call|> text
    ("\n<|channel|>commentary to=functions.now<|message|>", None, [("now", {})]),  # no arguments
    ("Hello there!", "Hello there!", []),  # a final-channel answer
    ("<|channel|>commentary<|message|>A preamble.", "<|channel|>commentary<|message|>A preamble.", []),
    ("to=functions.f", "to=functions.f", []),  # a header cut short is content
])
def test_harmony(text, content, calls):
    message = parse("harmony", text)
    assert message.content == content and calls_of(message) == calls


def test_named_tool_parser():
    parser = NamedToolParser("get_time", counting_ids())
    deltas = [parser.feed('{"utc_'), parser.feed('offset": 2}'), parser.finish()]
    message = ParsedMessage.from_deltas(deltas)
    assert message.content is None
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [
        ("call_0", "get_time", '{"utc_offset": 2}')]
    empty = parse_tool_calls("", NamedToolParser("f", counting_ids()))
    assert [(c.name, c.arguments) for c in empty.tool_calls] == [("f", "{}")]


def test_parser_for_template():
    assert parser_for_template(None) == "hermes"
    assert parser_for_template("... <tool_call>\n{...}\n</tool_call> ...") == "hermes"
    llama3 = 'Respond with {"name": function name, "parameters": dictionary of argument name and value}'
    assert parser_for_template(llama3) == "json"
    assert parser_for_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        make_parser("xml")


# -- streaming equals whole, for any split ---------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
spacing = st.sampled_from(["", " ", "\n", "\n\n"])
contents = st.text(alphabet=st.characters(blacklist_characters="<{["), max_size=20)


@st.composite
def hermes_answers(draw):
    calls = draw(st.lists(st.tuples(names, arguments), max_size=3))
    parts = [draw(contents)]
    for name, args in calls:
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=draw(st.booleans()))
        parts.append(f"<tool_call>{draw(spacing)}{body}{draw(spacing)}</tool_call>{draw(spacing)}")
    return "".join(parts), calls


@st.composite
def json_answers(draw):
    calls = draw(st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
    bodies = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
    if draw(st.booleans()):
        return "[" + ", ".join(bodies) + "]", calls
    return draw(st.sampled_from(["; ", ";", "\n"])).join(bodies), calls


@st.composite
def harmony_answers(draw):
    if draw(st.booleans()):
        return draw(contents), []
    name, args = draw(names), draw(arguments)
    header = draw(st.sampled_from([f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                                   f"to=functions.{name}<|channel|>commentary json<|message|>"]))
    return draw(spacing) + header + json.dumps(args) + draw(st.sampled_from(["", "<|call|>"])), [(name, args)]


def split_points(text):
    return st.lists(st.integers(0, len(text)), max_size=8).map(sorted)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["hermes", "json", "harmony"]))
def test_streaming_in_any_chunks_equals_the_whole(data, kind):
    answers = {"hermes": hermes_answers, "json": json_answers, "harmony": harmony_answers}[kind]
    text, calls = data.draw(answers())
    cuts = data.draw(split_points(text))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = parse(kind, text)
    streamed = ParsedMessage.from_deltas(stream(kind, chunks))
    assert streamed == whole
    assert calls_of(whole) == [(name, args) for name, args in calls]
    if kind == "hermes":
        assert (whole.content or "").strip() == text.split("<tool_call>")[0].strip() or calls == []
