"""Interactive chat in the terminal: tokens are printed as the engine produces them."""

from __future__ import annotations

import dataclasses
import sys

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def run_chat(config: EngineConfig, sampling: dict, system: str | None) -> int:
    """sampling: the SamplingParams fields the user set; the others are the model's defaults
    (generation_config.json), then the library's, but max_tokens: a reply runs until it ends or
    the context is full unless told otherwise, as /v1/chat/completions does."""
    engine = LLMEngine(config)
    params = dataclasses.replace(engine.input_processor.default_sampling_params(),
                                 **{"max_tokens": None, **sampling}, output_kind=RequestOutputKind.DELTA)
    messages = [{"role": "system", "content": system}] if system else []
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    for turn in range(1_000_000):
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.input_processor.chat_prompt(messages)
        reply = _stream_reply(engine, f"turn-{turn}", prompt, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _stream_reply(engine: LLMEngine, request_id: str, prompt: dict, params: SamplingParams) -> str:
    """Print each new piece of text as it comes; the whole reply."""
    engine.add_request(request_id, prompt, params)
    pieces = []
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                piece = output.outputs[0].text if output.outputs else ""
                print(piece, end="", flush=True)
                pieces.append(piece)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    print()
    return "".join(pieces)
