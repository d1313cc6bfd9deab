"""Reasoning on the chat endpoint (`--reasoning-parser`): each choice's answer split into
reasoning_content (also sent as vLLM's newer `reasoning`) and content, whole or as stream deltas,
the content then read for tool calls; and the request's output constraint moved after the
reasoning, with its thinking budget.

- Where the answer starts is read from the prompt's end (pagedllm.text.reasoning.prompt_state):
  a template that closed the reasoning (Qwen3's with chat_template_kwargs.enable_thinking false)
  makes every answer content, and then no constraint moves and no budget applies.
- response_format / structured_outputs / forced tool calls apply to the content only: the spec
  gets a ReasoningPrefix (pagedllm.structured.reasoning_grammar), so the model thinks freely and
  then writes what the constraint allows.
- thinking_token_budget (vLLM's name): at most that many tokens of reasoning, then the end
  marker is forced, through the same grammar. It needs a reasoning parser (which knows the
  markers); without one it is a 400.
- A parser whose markers are special tokens (gpt_oss's Harmony channels) gives the grammar its
  markers as tokens and the content's headers (the final channel's), which the model may write
  before the constrained answer.
"""

from __future__ import annotations

from typing import Any

from pagedllm.server.protocol import APIError
from pagedllm.server.structured import ToolCallReader
from pagedllm.structured.spec import GrammarSpec, ReasoningPrefix
from pagedllm.text.reasoning import PromptState, ReasoningFormat, ReasoningSplitter, prompt_state


def constraint_after_reasoning(fmt: ReasoningFormat | None, prompt: str, spec: GrammarSpec | None,
                               budget: int | None) -> GrammarSpec | None:
    """The request's grammar spec as the engine should run it: after the reasoning, where the
    answer to this prompt may reason; a budget alone constrains nothing but the reasoning."""
    if fmt is None:
        if budget is not None:
            raise APIError("thinking_token_budget needs a server started with --reasoning-parser "
                           "(which knows where the reasoning ends)", param="thinking_token_budget")
        return spec
    state = prompt_state(fmt, prompt)
    if state == "content" or (spec is None and budget is None):
        return spec
    # deepseek_r1 counts unopened text before the end marker as reasoning: the reasoning is open.
    mode = "open" if state == "reasoning" or fmt.implicit_start else "optional"
    prefix = ReasoningPrefix(fmt.start, fmt.end, mode, budget, fmt.content_headers, fmt.special_tokens)
    return spec.after_reasoning(prefix) if spec is not None else GrammarSpec.any_text(prefix)


class ReasoningReader:
    """One choice's answer: the reasoning split off, the content passed on (to its tool-call
    reader, if it has one). The same interface as ToolCallReader."""

    def __init__(self, fmt: ReasoningFormat, state: PromptState, tools: ToolCallReader | None) -> None:
        self._splitter = ReasoningSplitter(fmt, state)
        self._tools = tools

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer as an assistant message, and the choice's finish_reason."""
        reasoning, content = self._splitter.split(text)
        if self._tools is None:
            message: dict[str, Any] = {"role": "assistant", "content": content}
        else:
            message, finish_reason = self._tools.message(content or "", finish_reason)
        return {"role": "assistant", **_reasoning_fields(reasoning), **message}, finish_reason

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The next piece of a streamed answer as a chunk's delta (reasoning before content), and
        the finish_reason (on the last piece)."""
        reasoning, content = self._splitter.feed(text)
        if finish_reason is not None:
            more_reasoning, more_content = self._splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta = _reasoning_fields(reasoning) if reasoning else {}
        if self._tools is None:
            if content:
                delta["content"] = content
            return delta, finish_reason
        fields, finish_reason = self._tools.delta(content, finish_reason)
        return {**delta, **fields}, finish_reason


def _reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    return {"reasoning_content": reasoning, "reasoning": reasoning}
