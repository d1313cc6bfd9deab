"""Speculative decoding through `pagedllm serve` (the core in its own process): a streamed answer
comes in deltas of several tokens and reads as the plain server's, the non-streamed answer is the
same text, and /metrics carries the counters under vLLM's names."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import RunningServer, metric_value, tiny_config

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]
BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}


def stream_deltas(base_url: str) -> list[str]:
    deltas = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["text"] for c in json.loads(line[6:])["choices"]]
    return deltas


@pytest.fixture(scope="module")
def plain_text(tiny_model_dir) -> str:
    with RunningServer(tiny_config(tiny_model_dir, max_model_len=64)) as server:
        response = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]


def test_streamed_and_whole_answers_equal_the_plain_servers_and_metrics_count(tiny_model_dir, plain_text):
    with RunningServer(tiny_config(tiny_model_dir, max_model_len=64, speculative_config=SPEC)) as server:
        deltas = stream_deltas(server.base_url)
        whole = httpx.post(f"{server.base_url}/v1/completions", json=BODY, timeout=60).json()
        drafts = metric_value(server.base_url, "spec_decode_num_draft_tokens_total")
        accepted = metric_value(server.base_url, "spec_decode_num_accepted_tokens_total")
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "".join(deltas) == whole["choices"][0]["text"] == plain_text
    assert whole["usage"]["completion_tokens"] == 40
    assert len([d for d in deltas if d]) < 40  # some deltas carried several tokens
    assert 0 < accepted <= drafts
    assert 'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
