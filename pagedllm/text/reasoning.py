"""Reasoning parsers: a thinking model's answer split into its reasoning and its content.

Models of the Qwen3 and DeepSeek-R1 families think before they answer, writing
`<think>reasoning</think>content`. With `--reasoning-parser NAME` the server returns the two
apart (message.reasoning_content and vLLM's newer message.reasoning, and the same fields in
stream deltas), so that chat UIs, JSON-mode clients and tool-call parsing see only the content.
The names and rules are vLLM's:

- qwen3: the text between `<think>` and `</think>` is reasoning; an answer that does not open
  with `<think>` is all content.
- deepseek_r1: everything before `</think>` is reasoning, whether or not `<think>` opened it
  (the R1 template writes the opening tag into the prompt); no `</think>` at all (cut by
  max_tokens while thinking) is all reasoning.
- gpt_oss (vLLM's openai_gptoss): OpenAI's Harmony channels. The template ends the prompt
  with `<|start|>assistant`; the model writes `<|channel|>analysis<|message|>reasoning<|end|>`
  and then `<|start|>assistant<|channel|>final<|message|>content` (ended by `<|return|>`, an
  EOS id), or the final channel alone. The analysis message is the reasoning, the final one
  the content; the content's headers are dropped as whitespace is. Harmony's markers are
  special tokens, so the answer is decoded with them (ReasoningFormat.special_tokens:
  skip_special_tokens is off for its chat answers). Other channels stay in the content: text
  after `<|end|>` that is not the final channel's, where the harmony tool-call format reads a
  call to a function (structured/tool_parser_harmony.py).

Where the answer starts is the chat template's decision, read from the prompt's end
(prompt_state): a prompt ending in `</think>` (Qwen3's template with enable_thinking false)
leaves no room to think, so all output is content whatever the parser; a prompt ending in an
open `<think>` (R1's, Qwen3-2507-thinking's) starts the answer inside the reasoning.

The split is incremental (ReasoningSplitter: text in as it is generated, reasoning and content
out) and the whole answer is split by the same code, so streamed pieces always concatenate to
the non-streamed fields. Text that may be the start of a marker is held back until it is known
not to be one. Whitespace around the reasoning, and before the content, is dropped (Qwen3 writes
`<think>\\n...\\n</think>\\n\\n`): JSON-mode content then begins with its `{`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where an answer starts: deciding (the model may or may not open the reasoning), inside the
# reasoning, or in the content (the template closed the reasoning, or there is none).
PromptState = Literal["start", "reasoning", "content"]


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its reasoning."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # deepseek_r1: text before the end marker is reasoning even if the start marker never came.
    implicit_start: bool = False
    # Headers that open the content (gpt_oss: the final channel's), each dropped where the content
    # starts with it, in this order, as the whitespace before the content is.
    content_headers: tuple[str, ...] = ()
    # Special tokens of the model's vocabulary that the markers are made of, and the others its
    # answers hold (gpt_oss: Harmony's, a tool call's among them). Any: answers are decoded with
    # special tokens kept, or the markers vanish before the split.
    special_tokens: tuple[str, ...] = ()


_HARMONY = ReasoningFormat("gpt_oss", start="<|channel|>analysis<|message|>", end="<|end|>",
                           content_headers=("<|start|>assistant", "<|channel|>final<|message|>"),
                           special_tokens=("<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                           "<|constrain|>"))
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", implicit_start=True),
    "gpt_oss": _HARMONY,
    "openai_gptoss": _HARMONY,  # vLLM's name for it
}
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)


def reasoning_format(name: str) -> ReasoningFormat:
    """The parser of a name; ValueError naming the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(REASONING_PARSER_NAMES)}") from None


def prompt_state(fmt: ReasoningFormat, prompt: str) -> PromptState:
    """Where the answer to this prompt starts, as its chat template left it: "content" if the
    prompt ends with the end marker (thinking turned off), "reasoning" if it ends with the start
    marker (the template opened the reasoning), else "start". Markers earlier in the prompt
    (earlier turns' reasoning, a user quoting a tag) do not count."""
    tail = prompt.rstrip()
    if tail.endswith(fmt.end):
        return "content"
    if tail.endswith(fmt.start):
        return "reasoning"
    return "start"


class ReasoningSplitter:
    """One answer's text, fed as it is generated, split into reasoning and content pieces.
    split(text) is feed(text) and finish() at once: the whole answer's two parts."""

    def __init__(self, fmt: ReasoningFormat, state: PromptState) -> None:
        self.fmt = fmt
        # "start" | "reasoning" | "content_lead" (content, its leading whitespace dropped) | "content"
        self._state: str = "content_lead" if state == "content" else state
        if state == "reasoning":
            self._state = "reasoning_lead"
        self._held = ""  # text not yet given out: maybe a marker's beginning, or whitespace
        self._headers_left = fmt.content_headers  # those the content has not opened with (yet)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole answer: (reasoning, content), None for an empty part."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def feed(self, text: str) -> tuple[str, str]:
        """The next piece of the answer; the (reasoning, content) it makes known."""
        self._held += text
        reasoning, content = [], []
        while self._held:
            progressed = self._step(reasoning, content)
            if not progressed:
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held back, as the part it belongs to."""
        held, self._held = self._held, ""
        state = self._state
        if state == "start":
            stripped = held.lstrip()
            if self.fmt.implicit_start:
                return stripped.removeprefix(self.fmt.start).strip(), ""
            return "", stripped  # a marker's beginning that never finished: content
        if state in ("reasoning", "reasoning_lead"):
            return held.strip() if state == "reasoning_lead" else held.rstrip(), ""
        if state == "content_lead":
            return "", self._without_headers(held.lstrip())
        return "", held

    # -- one move of the state machine; False: it needs more text ---------------------------------
    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        state = self._state
        if state == "start":
            return self._decide_start()
        if state == "reasoning_lead":
            self._held = self._held.lstrip()
            if not self._held:
                return False
            self._state = "reasoning"
            return True
        if state == "reasoning":
            return self._reason(reasoning)
        if state == "content_lead":
            return self._lead_content()
        content.append(self._held)
        self._held = ""
        return True

    def _lead_content(self) -> bool:
        """Drop the whitespace and headers before the content; wait while what is held could
        still be (the beginning of) one of them."""
        held = self._without_headers(self._held.lstrip())
        self._held = held
        if not held or any(h.startswith(held) for h in self._headers_left):
            return False
        self._state = "content"
        return True

    def _without_headers(self, text: str) -> str:
        """text with the content headers it opens with dropped (each once, in order, whitespace
        between them too); those still to come are remembered."""
        while self._headers_left:
            header = self._headers_left[0]
            if not text.startswith(header):
                if header.startswith(text):  # maybe its beginning: wait for more
                    return text
                self._headers_left = self._headers_left[1:]  # this header was left out
                continue
            text = text[len(header):].lstrip()
            self._headers_left = self._headers_left[1:]
        return text

    def _decide_start(self) -> bool:
        """Does the answer open the reasoning? Wait while its start could still be the marker."""
        start = self.fmt.start
        stripped = self._held.lstrip()
        if stripped.startswith(start):
            self._held = stripped[len(start):]
            self._state = "reasoning_lead"
            return True
        if start.startswith(stripped):  # empty, or a marker's beginning
            return False
        if self.fmt.implicit_start:
            self._held = stripped
            self._state = "reasoning"
        else:
            self._state = "content_lead"
        return True

    def _reason(self, reasoning: list[str]) -> bool:
        """Give out reasoning up to the end marker; hold back what may be the marker's beginning
        and trailing whitespace (dropped if the marker follows)."""
        end = self.fmt.end
        at = self._held.find(end)
        if at >= 0:
            reasoning.append(self._held[:at].rstrip())
            self._held = self._held[at + len(end):]
            self._state = "content_lead"
            return True
        keep = _marker_prefix_len(self._held, end)
        body, tail = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        text = body.rstrip()
        if not text:
            return False
        reasoning.append(text)
        self._held = body[len(text):] + tail
        return False


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of text that is a beginning of marker (held back: the rest
    of the marker may follow)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
