"""The copy-heavy workload: prompts whose answers echo them, from the shipped corpus; its flag on
bench throughput; bench proposers, which measures the proposers against its answers; and bench
repeated, which sends each of its requests twice."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.bench import proposers
from pagedllm.bench.workload import COPY_TASKS, copy_reference_pairs, copy_workload, load_workload
from pagedllm.cli import main
from pagedllm.model.tokenizer_files import load_tokenizer
from pagedllm.spec_decode import NgramProposer
from pagedllm.spec_decode.ngram import lookup
from tests.model.tiny import make_hf_model, write_gguf


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the default model's


def test_answers_echo_their_prompts(tokenizer):
    """Most of each reference answer can be read off its prompt: prompt lookup (n-gram 2-5), one
    token after another, guesses at least 40% of every answer's tokens and 60% of all."""
    pairs = copy_reference_pairs(tokenizer, 9, seed=3)
    assert len(pairs) == 9
    total = total_guessed = 0
    for prompt, answer in pairs:
        guessed = 0
        for i in range(len(answer)):
            context = np.asarray(prompt + answer[:i], dtype=np.int64)
            guessed += lookup(context, 2, 5, 1) == [answer[i]]
        assert guessed >= 0.4 * len(answer), (guessed, len(answer))
        total, total_guessed = total + len(answer), total_guessed + guessed
    assert total_guessed >= 0.6 * total


def test_requests_are_chat_prompts_sized_to_their_answers(tokenizer):
    requests = copy_workload(tokenizer, 6, seed=0)
    pairs = copy_reference_pairs(tokenizer, 6, seed=0)
    for request, (prompt, answer) in zip(requests, pairs):
        assert request.prompt_token_ids == prompt and request.max_tokens == len(answer) + 16
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    kinds = [tokenizer.decode(r.prompt_token_ids) for r in requests[:3]]
    assert "Rewrite the passage" in kinds[0] and "Rename `" in kinds[1] and "JSON template" in kinds[2]
    assert len(COPY_TASKS) == 3
    assert copy_workload(tokenizer, 6, seed=0) == requests  # the seed decides
    assert copy_workload(tokenizer, 6, seed=1) != requests


def test_load_workload_takes_the_kind(tokenizer):
    assert load_workload(tokenizer, "random", 4, "8", "4", 0, "copy") == copy_workload(tokenizer, 4, 0)
    with pytest.raises(ValueError, match="takes no --dataset"):
        load_workload(tokenizer, "prompts.jsonl", 4, None, None, 0, "copy")
    with pytest.raises(ValueError, match="workload must be one of default, copy"):
        load_workload(tokenizer, "random", 4, "8", "4", 0, "echo")
    with pytest.raises(ValueError, match="at least 1"):
        copy_workload(tokenizer, 0)


def test_bench_throughput_runs_the_copy_workload(tmp_path):
    model = write_gguf(make_hf_model("llama_gqa_untied", max_position_embeddings=2048),
                       tmp_path / "tiny.gguf")
    out = tmp_path / "out.json"
    assert main(["bench", "throughput", "--model", str(model), "--workload", "copy", "--num-prompts", "2",
                 "--dtype", "float32", "--kv-cache-memory", "8MiB", "--threads", "1",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["kind"] == "copy" and result["workload"]["num_requests"] == 2
    assert result["workload"]["output_tokens"] > 50  # the answers' lengths, not --output-len's
    assert result["pagedllm"]["output_tokens_per_s"] > 0


def test_bench_proposers_measures_cost_and_tokens_per_step(tokenizer):
    pairs = copy_reference_pairs(tokenizer, 3, seed=0)
    result = proposers.tokens_per_step(NgramProposer(2, 5), pairs, k=4)
    assert 1.0 < result["tokens_per_step"] <= 5.0 and 0 < result["acceptance_rate"] <= 1
    corpus_ids = list(range(1, 50)) * 40
    timing = proposers.time_calls(NgramProposer(2, 5), corpus_ids, num_seqs=4, context_len=100, k=3, calls=3)
    assert timing["ms_per_call_median"] >= 0 and timing["first_call_ms"] >= 0


def test_bench_repeated_times_each_engine_on_each_repeat(tmp_path, monkeypatch):
    """bench repeated: every engine answers every request twice (counted), and the JSON holds a
    speed per repeat and engine."""
    from pagedllm.bench import repeated

    model = write_gguf(make_hf_model("llama_gqa_untied", max_position_embeddings=2048),
                       tmp_path / "tiny.gguf")
    calls: dict[int, int] = {}
    answer = repeated.answer

    def counted(engine, prompt_token_ids, max_tokens):
        calls[id(engine)] = calls.get(id(engine), 0) + 1
        return answer(engine, prompt_token_ids, max_tokens)

    monkeypatch.setattr(repeated, "answer", counted)
    out = tmp_path / "repeated.json"
    assert main(["bench", "repeated", "--model", str(model), "--num-prompts", "2", "--dtype", "float32",
                 "--kv-cache-memory", "8MiB", "--threads", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(calls.values()) == [4, 4, 4]  # 2 requests x (first, repeat) for each of 3 engines
    assert set(result["tokens_per_s"]) == {"plain", "ngram", "suffix"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["tokens_per_s"].values())
