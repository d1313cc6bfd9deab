"""A scripted model for server tests: an extension of the engine core (core_process --extension)
that makes the tiny byte-tokenizer model say what the prompt tells it to.

A prompt holding `SAY[text]END` gets `text` as its greedy answer, then EOS: every sampled row's
logits are replaced by a script's, the next byte of `text` far ahead of the rest and the rest in
falling order by id (so a grammar that refuses the script's byte gets its lowest allowed id, a
choice the test can predict). The script's logits go through everything the engine does to
logits (the grammar's mask above all, which is what the reasoning tests look at): only the
model's numbers are replaced.

Where a grammar forced the reasoning's end marker early (a thinking budget), the answer follows
the script again from the script's own end marker on: the byte after the answer's last
`</think>` (or Harmony's `<|end|>`) is the byte after the script's.

Harmony's markers (gpt-oss: `<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`,
`<|constrain|>`, `<|call|>`) are the special tokens 258-264 of the tokenizer
tests/server/test_reasoning.py gives such a model: a script says each as its one token, and a
prompt holding them reads back as their text.
"""

from __future__ import annotations

import re

import torch

EOS = 257  # the tiny tokenizer's (tests/model/tiny.py)
HARMONY_TOKENS = {"<|start|>": 258, "<|channel|>": 259, "<|message|>": 260, "<|end|>": 261, "<|return|>": 262,
                  "<|constrain|>": 263, "<|call|>": 264}
_HARMONY_TEXT = {token: text for text, token in HARMONY_TOKENS.items()}
END_MARKERS = ("</think>", "<|end|>")
_SCRIPT = re.compile(r"SAY\[(.*?)\]END", re.S)


def text_of(token_ids: list[int]) -> str:
    """Byte tokens as latin-1 text, Harmony's as their markers; other ids (BOS, EOS) dropped."""
    return "".join(chr(t) if t < 256 else _HARMONY_TEXT.get(t, "") for t in token_ids)


def tokens_of(text: str, markers: dict[str, int] = HARMONY_TOKENS) -> list[int]:
    """The script's tokens: each marker (Harmony's) one token, every other character its byte."""
    tokens, at = [], 0
    while at < len(text):
        marker = next((m for m in markers if text.startswith(m, at)), None)
        tokens.append(markers[marker] if marker else ord(text[at]))
        at += len(marker) if marker else 1
    return tokens


def script_of(prompt_ids: list[int]) -> str | None:
    """The text a prompt asks to be said (its last SAY[...]END), or None."""
    found = _SCRIPT.findall(text_of(prompt_ids))
    return found[-1] if found else None


def next_token(script: str, output_ids: list[int]) -> int:
    """The script's next token after this output, or EOS once it is all said."""
    said = text_of(output_ids)
    position = len(tokens_of(said))
    for marker in END_MARKERS:
        if marker in said and marker in script:
            resumed = script[:script.index(marker) + len(marker)] + said.rsplit(marker, 1)[1]
            position = len(tokens_of(resumed))
            break
    script_tokens = tokens_of(script)
    return script_tokens[position] if position < len(script_tokens) else EOS


def scripted_logits(vocab_size: int, token: int) -> torch.Tensor:
    logits = -0.01 * torch.arange(vocab_size, dtype=torch.float32)
    logits[token] = 100.0
    return logits


def extend(loop) -> None:
    """Called by the core process once the core is loaded: script the model's step."""
    executor = loop.core.executor
    real_execute = executor.execute
    loop.core.decode_burst = 1  # a burst's steps run inside the runner, past this script

    def execute(out, argmax_only=False, prompt_logprobs=None):
        result = real_execute(out, argmax_only, prompt_logprobs)
        scheduled = out.scheduled
        if not result.sample_indices:
            return result
        rows = []
        for i in result.sample_indices:
            request = scheduled[i].request
            script = script_of(request.prompt_token_ids)
            rows.append(None if script is None else next_token(script, request.output_token_ids))
        if argmax_only:  # the engine takes these as the tokens
            tokens = result.logits.clone()
            for row, token in enumerate(rows):
                if token is not None:
                    tokens[row] = token
            return result._replace(logits=tokens)
        logits = result.logits.clone()
        for row, token in enumerate(rows):
            if token is not None:
                logits[row] = scripted_logits(logits.shape[1], token)
        return result._replace(logits=logits)

    executor.execute = execute
