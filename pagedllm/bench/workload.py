"""Benchmark workloads shared by every bench: the same requests for every system compared.

`random`: prompt and output lengths drawn uniformly from ranges with a seed; prompt tokens are
cut from a real English corpus shipped with the package (pagedllm/data/corpus.txt: the Python
standard library's documentation strings, PSF license), never random ids. A `.jsonl` file gives
one {"prompt": ..., "max_tokens": ...} per line.

`copy` (--workload copy): chat prompts whose answers echo their input, the work speculative
decoding speeds up: edit a passage (replace one word, keep the rest), refactor code (rename a
variable in a code example), fill a JSON template from a text (field names repeated, sentences
quoted). Passages and code come from the same corpus; each request's max_tokens is about the
length of the answer it asks for, so most of what a run generates is the echo.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def parse_range(text: str | int) -> tuple[int, int]:
    """"32-512" -> (32, 512); "128" -> (128, 128)."""
    low, _, high = str(text).partition("-")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"a length range must look like 32-512 with 1 <= low <= high; got {text!r}")
    return lo, hi


def corpus_text() -> str:
    return resources.files("pagedllm").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def random_workload(tokenizer, num_requests: int, input_len: str | int, output_len: str | int,
                    seed: int = 0) -> list[BenchRequest]:
    in_lo, in_hi = parse_range(input_len)
    out_lo, out_hi = parse_range(output_len)
    corpus_ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if len(corpus_ids) <= in_hi:
        raise ValueError(f"the corpus has {len(corpus_ids)} tokens; prompts of {in_hi} need more")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(in_lo, in_hi)
        start = rng.randrange(0, len(corpus_ids) - length)
        requests.append(BenchRequest(corpus_ids[start:start + length], rng.randint(out_lo, out_hi)))
    return requests


def file_workload(tokenizer, path: str | Path, num_requests: int | None = None) -> list[BenchRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, max_tokens = item["prompt"], int(item.get("max_tokens", 128))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected {{\"prompt\": ..., \"max_tokens\": ...}}: "
                                 f"{exc}") from exc
            requests.append(BenchRequest(tokenizer.encode(prompt), max_tokens))
            if num_requests is not None and len(requests) >= num_requests:
                break
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


WORKLOADS = ("default", "copy")  # default: what --dataset says


def load_workload(tokenizer, dataset: str, num_requests: int, input_len, output_len,
                  seed: int, workload: str = "default") -> list[BenchRequest]:
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {workload!r}")
    if workload == "copy":
        if dataset != "random":
            raise ValueError("--workload copy builds its own prompts from the corpus; it takes no "
                             f"--dataset (got {dataset!r})")
        return copy_workload(tokenizer, num_requests, seed)
    if dataset == "random":
        return random_workload(tokenizer, num_requests, input_len, output_len, seed)
    return file_workload(tokenizer, dataset, num_requests)


# -- the copy-heavy workload ----------------------------------------------------------------------
COPY_TASKS = ("edit", "refactor", "json")
# Replacement words for the edit task: plain, so the model has no reason to change anything else.
_EDIT_WORDS = ("widget", "gadget", "record", "object", "element", "item")
_JSON_TEMPLATE = {"topic": "", "first_sentence": "", "last_sentence": "", "key_terms": ["", "", ""]}


def copy_workload(tokenizer, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """num_requests copy-heavy requests, the tasks in turn (edit, refactor, json), each on a
    passage or code example drawn with the seed."""
    return [BenchRequest(prompt, len(answer) + 16)  # and a little for framing (a fence, a quote)
            for prompt, answer in copy_reference_pairs(tokenizer, num_requests, seed)]


def copy_reference_pairs(tokenizer, num_requests: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """The copy workload's (prompt ids, reference answer ids): what each request asks for, done
    exactly (the edited passage, the renamed code, the filled template)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1; got {num_requests}")
    prose, code = _corpus_passages()
    rng = random.Random(seed)
    pairs = []
    for i in range(num_requests):
        task = COPY_TASKS[i % len(COPY_TASKS)]
        if task == "edit":
            prompt, answer = _edit_task(rng.choice(prose), rng)
        elif task == "refactor":
            prompt, answer = _refactor_task(rng.choice(code))
        else:
            prompt, answer = _json_task(rng.choice(prose))
        answer_ids = tokenizer.encode(answer, add_special_tokens=False)
        pairs.append((_chat_prompt_ids(tokenizer, prompt), answer_ids))
    return pairs


def _corpus_passages() -> tuple[list[str], list[str]]:
    """The corpus's prose paragraphs (300-1200 characters) and its code examples (that parse as
    Python once their indentation and doctest prompts are gone, 120-1200 characters)."""
    prose, code = [], []
    for paragraph in re.split(r"\n\s*\n", corpus_text()):
        if not paragraph.startswith((" ", ">")) and 300 < len(paragraph) < 1200:
            prose.append(paragraph.strip())
        elif all(line.startswith("    ") for line in paragraph.splitlines()):
            example = _as_code(paragraph)
            if example is not None and 120 < len(example) < 1200:
                code.append(example)
    return prose, code


def _as_code(paragraph: str) -> str | None:
    lines = textwrap.dedent(paragraph).splitlines()
    if lines and lines[0].startswith(">>>"):
        lines = [line[4:] for line in lines if line.startswith((">>> ", "... "))]
    text = "\n".join(lines)
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    return text


def _edit_task(passage: str, rng: random.Random) -> tuple[str, str]:
    words = Counter(w for w in re.findall(r"[A-Za-z]{5,}", passage))
    old = words.most_common(1)[0][0]
    new = rng.choice(_EDIT_WORDS)
    prompt = (f"Rewrite the passage below exactly as it is, except that every \"{old}\" becomes "
              f"\"{new}\". Reply with the rewritten passage only.\n\n{passage}")
    return prompt, re.sub(rf"\b{old}\b", new, passage)


def _refactor_task(code: str) -> tuple[str, str]:
    names = Counter(node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name))
    old = names.most_common(1)[0][0] if names else "x"
    new = f"the_{old}"
    prompt = (f"Rename `{old}` to `{new}` in this Python code and change nothing else. Reply with "
              f"the complete code only.\n\n```python\n{code}\n```")
    renamed = re.sub(rf"\b{old}\b", new, code)
    return prompt, f"```python\n{renamed}\n```"


def _json_task(passage: str) -> tuple[str, str]:
    sentences = [s for s in re.split(r"(?<=[.:;])\s+", " ".join(passage.split())) if s]
    template = json.dumps(_JSON_TEMPLATE, indent=2)
    prompt = (f"Fill this JSON template from the text below, copying the sentences word for word. "
              f"Reply with the JSON only.\n\nTemplate:\n{template}\n\nText:\n{passage}")
    answer = {**_JSON_TEMPLATE, "first_sentence": sentences[0], "last_sentence": sentences[-1]}
    return prompt, json.dumps(answer, indent=2)


def _chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the model's chat template frames a user message (plain text without one)."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)


def summarize(requests: list[BenchRequest]) -> dict:
    return {"num_requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests)}
