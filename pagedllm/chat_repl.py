"""Interactive chat in the terminal: tokens are printed as the engine produces them."""

from __future__ import annotations

import sys

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def run_chat(config: EngineConfig, params: SamplingParams, system: str | None) -> int:
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
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
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = _stream_reply(engine, f"turn-{turn}", prompt, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _stream_reply(engine: LLMEngine, request_id: str, prompt: list[int],
                  params: SamplingParams) -> str:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                print(text[len(shown):], end="", flush=True)
                shown = text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    print()
    return shown
