"""Chat templates shaped like Gemma 2/3's, Qwen3's and Phi-3's (written here, using the same Jinja
features: whitespace control, `is string` content or content parts, messages[1:] and [::-1],
namespace assignment, str methods, tojson of tools, raise_exception) render in our sandbox exactly
as transformers renders them; and a system message a template refuses (Gemma 1/2) is folded into
the first user turn, as Gemma 3's template does itself."""

from __future__ import annotations

import pytest

from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, EOS, tokenizer_backend

transformers = pytest.importorskip("transformers")

# Gemma 3's shape: the system text becomes the first user turn's prefix.
GEMMA3_LIKE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = "" -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("roles must alternate user/assistant") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<turn>' + role + '\\n' + (prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<turn>model\\n' }}
{%- endif -%}
"""

# Gemma 1/2's shape: a system message is refused.
GEMMA2_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<turn>' + role + '\\n' + message['content'] | trim + '<end>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<turn>model\\n' }}{% endif %}")

# Qwen3's shape: tools as JSON, the last user query found walking backwards through a namespace,
# reasoning cut out of earlier assistant turns with str methods, an enable_thinking switch.
QWEN3_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "Tools:" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.last_query == messages|length - 1 and message.role == "user"
          and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') }}
            {{- '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Phi-3's shape: every role its own tag, the end token after each turn.
PHI3_LIKE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")

SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "  Hi there!  "}],
    "system first": [SYSTEM, {"role": "user", "content": "Hi"}],
    "several turns": [SYSTEM, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                      {"role": "user", "content": "and 3+3?"},
                      {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": " parts "}]}],
    "roles out of order": [{"role": "assistant", "content": "first"}],
}
TEMPLATES = {"gemma3": GEMMA3_LIKE, "gemma2": GEMMA2_LIKE, "qwen3": QWEN3_LIKE, "phi3": PHI3_LIKE}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds <a> & <b>",
                                           "parameters": {"type": "object"}}}]


def tokenizer_with(template: str) -> Tokenizer:
    return Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS}, template)


def render(tokenizer, messages, **kwargs):
    """The rendered text, or the exception type it raised."""
    try:
        return tokenizer(messages, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- compared, not swallowed
        return type(exc)


# Content parts are a Gemma 3 template feature.
CASES = [(template, conversation) for template in ("gemma3", "qwen3", "phi3")
         for conversation in CONVERSATIONS
         if template == "gemma3" or conversation != "content parts"]


@pytest.mark.parametrize("template, conversation", CASES)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers(template, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = tokenizer_with(TEMPLATES[template])
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_backend(), bos_token=BOS, eos_token=EOS)
    extra = {"tools": TOOLS, "enable_thinking": False} if template == "qwen3" else {}
    expected = render(lambda m, **kw: theirs.apply_chat_template(
        m, chat_template=TEMPLATES[template], tokenize=False, **kw), messages,
        add_generation_prompt=generation_prompt, **extra)
    got = render(ours.apply_chat_template, messages, add_generation_prompt=generation_prompt,
                 **extra)
    if isinstance(expected, type):  # the template refused the conversation
        assert got is ValueError
    else:
        assert got == expected


def test_refused_system_message_is_folded_into_the_first_user_turn():
    conversation = CONVERSATIONS["several turns"]
    folded = tokenizer_with(GEMMA2_LIKE).apply_chat_template(conversation)
    assert folded.startswith(f"{BOS}<turn>user\nBe brief.\n\n2+2?<end>\n<turn>model\n")
    # What Gemma 3's template makes of the same conversation by itself.
    assert tokenizer_with(GEMMA3_LIKE).apply_chat_template(conversation) == folded


def test_other_refusals_still_fail_with_the_templates_message():
    tokenizer = tokenizer_with(GEMMA2_LIKE)
    bad = [SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="System role not supported"):
        tokenizer.apply_chat_template(bad)  # folding does not fix the order: the first complaint
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.apply_chat_template(CONVERSATIONS["roles out of order"])


def test_phi3_like_template_ends_with_eos_without_generation_prompt():
    text = tokenizer_with(PHI3_LIKE).apply_chat_template(
        CONVERSATIONS["one turn"], add_generation_prompt=False)
    assert text.endswith(f"<|end|>\n{EOS}")


@pytest.mark.parametrize("template", ["gemma3", "qwen3", "phi3"])
@pytest.mark.parametrize("last", ["The answer is", "The answer is ", "  padded  "])
def test_continue_final_message_cuts_as_transformers(template, last):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": last}]
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_backend(), bos_token=BOS, eos_token=EOS)
    expected = theirs.apply_chat_template(messages, chat_template=TEMPLATES[template], tokenize=False,
                                          add_generation_prompt=False, continue_final_message=True)
    got = tokenizer_with(TEMPLATES[template]).apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and got.rstrip().endswith(last.strip())


def test_a_template_given_per_call_replaces_the_models():
    tokenizer = tokenizer_with(PHI3_LIKE)
    own = "{% for m in messages %}[{{ m['content'] }}|{{ flavour }}]{% endfor %}"
    assert tokenizer.apply_chat_template(CONVERSATIONS["one turn"], chat_template=own,
                                         flavour="x") == "[  Hi there!  |x]"
    assert tokenizer.apply_chat_template(CONVERSATIONS["one turn"]).startswith("<|user|>")


def test_load_chat_template_takes_a_file_or_the_text(tmp_path):
    from pagedllm.text.chat_template import load_chat_template

    file = tmp_path / "t.jinja"
    file.write_text(PHI3_LIKE)
    assert load_chat_template(str(file)) == PHI3_LIKE
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1"):
        load_chat_template("{% for m in messages %}")
