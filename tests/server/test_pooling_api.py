"""A pooling server (--runner pooling) on a tiny random Qwen3, float32: the official openai client's
embeddings.create unchanged (base64 by default, floats, dimensions, token ids, usage) equal to
transformers' pooled hidden states; /v1/rerank and /score order documents as the same reranker
computation in transformers; and requests the engine cannot run get 400s naming the field."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from pagedllm.text.score_prompt import score_prompt
from tests.model.tiny import make_hf_classifier, make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

TEXTS = ["The quick brown fox jumps over the lazy dog.", "paged attention", "x"]
QUERY = "what do foxes jump over?"
DOCUMENTS = ["the lazy dog", "a paged KV cache", "fences, mostly", "nothing at all here"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    hf = make_hf_model("qwen3_qk_norm", max_position_embeddings=512)  # room for the reranker's prompt
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("qwen3-serve-pool"))


@pytest.fixture(scope="module")
def pooling_server(qwen3):
    config = tiny_config(qwen3[1], runner="pooling", score_tokens=("n", "y"), max_num_batched_tokens=64)
    with RunningServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(pooling_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pooling_server.base_url}/v1", api_key="unused", max_retries=0)


def last_token_embedding(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return F.normalize(hidden, dim=0)


def reranker_score(hf, server, query: str, document: str) -> float:
    tokenizer = server.async_engine.input_processor.tokenizer
    text, spans = score_prompt(query, document)
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("n", "y"))
    with torch.no_grad():
        logits = hf(torch.tensor([tokenizer.encode(text, plain_spans=spans)])).logits[0, -1]
    return torch.softmax(logits[[no, yes]], dim=0)[1].item()


def test_the_openai_client_embeds_as_transformers_pools(qwen3, pooling_server, client):
    hf, _ = qwen3
    tokenizer = pooling_server.async_engine.input_processor.tokenizer
    answer = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # base64, decoded by the client
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == MODEL_NAME
    ids = [tokenizer.encode(t) for t in TEXTS]
    expected = torch.stack([last_token_embedding(hf, i) for i in ids])
    got = torch.tensor([d.embedding for d in answer.data])
    assert F.cosine_similarity(expected, got).min().item() >= 0.9999
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    assert floats.data[0].embedding == answer.data[0].embedding  # float32 either way
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), got[1], rtol=0, atol=1e-6)


def test_vllms_pooling_endpoint_gives_a_causal_lms_embedding(pooling_server, client):
    embedded = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], encoding_format="float")
    pooled = httpx.post(f"{pooling_server.base_url}/pooling", json={"input": TEXTS[:2]}, timeout=60).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert [d["data"] for d in pooled["data"]] == [d.embedding for d in embedded.data]


def test_metrics_count_pooling_requests_without_generation_figures(pooling_server, client):
    """A pooling request's prompt and times are measured; it generates nothing, so no tokens or
    finish reasons (the metrics once failed on its output, and with them the answer)."""
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{pooling_server.base_url}/metrics", timeout=60).text
        prompts = float(re.search(r"^vllm:request_prompt_tokens_count (\S+)$", text, re.M).group(1))
        return prompts, float("request_success_total{" in text)

    before = counts()
    client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2])
    assert counts() == (before[0] + 2, 0.0)


def test_dimensions_cut_then_normalize(client):
    full = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], extra_body={"normalize": False})
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=8)
    assert len(cut.data[0].embedding) == 8
    expected = F.normalize(torch.tensor(full.data[0].embedding[:8]), dim=0)
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), expected, rtol=0, atol=1e-6)


def test_rerank_and_score_order_documents_as_transformers_does(qwen3, pooling_server):
    hf, _ = qwen3
    expected = [reranker_score(hf, pooling_server, QUERY, d) for d in DOCUMENTS]
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    answer = httpx.post(f"{pooling_server.base_url}/v1/rerank", timeout=60, json={
        "model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    assert [r["index"] for r in answer["results"]] == best_first[:3]
    assert [r["document"]["text"] for r in answer["results"]] == [DOCUMENTS[i] for i in best_first[:3]]
    assert [r["relevance_score"] for r in answer["results"]] == \
        pytest.approx([expected[i] for i in best_first[:3]], abs=1e-5)
    assert answer["usage"]["total_tokens"] > 0
    bare = httpx.post(f"{pooling_server.base_url}/rerank", timeout=60, json={
        "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "return_documents": False}).json()
    assert [r["index"] for r in bare["results"]] == best_first and "document" not in bare["results"][0]
    scored = httpx.post(f"{pooling_server.base_url}/score", timeout=60, json={
        "model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in scored["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/embeddings", {"input": "hi", "dimensions": 65}, "dimensions", "at most the model's hidden size"),
    ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "as many as text_2"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model", "--runner pooling"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "--runner pooling"),
])
def test_what_a_pooling_engine_cannot_run_is_a_400_naming_the_field(pooling_server, path, body, param,
                                                                      words):
    response = httpx.post(f"{pooling_server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert pooling_server.wait_idle().num_running == 0


def test_a_classifier_server_reranks_with_its_head_and_pools_its_raw_logits(tmp_path_factory):
    hf = make_hf_classifier("qwen3_qk_norm", 1, max_position_embeddings=512)
    folder = save_checkpoint(hf, tmp_path_factory.mktemp("qwen3-classifier"))
    with RunningServer(tiny_config(folder, task="score", max_num_batched_tokens=64)) as server:
        tokenizer = server.async_engine.input_processor.tokenizer
        expected = []
        for document in DOCUMENTS:
            text, spans = score_prompt(QUERY, document)
            with torch.no_grad():
                logit = hf(torch.tensor([tokenizer.encode(text, plain_spans=spans)])).logits[0, 0]
            expected.append(torch.sigmoid(logit).item())
        answer = httpx.post(f"{server.base_url}/v1/rerank", timeout=60,
                            json={"query": QUERY, "documents": DOCUMENTS}).json()
        assert [r["index"] for r in answer["results"]] == sorted(range(4), key=lambda i: -expected[i])
        assert [r["relevance_score"] for r in answer["results"]] == \
            pytest.approx(sorted(expected, reverse=True), abs=1e-5)
        pooled = httpx.post(f"{server.base_url}/pooling", json={"input": TEXTS[0]}, timeout=60).json()
        with torch.no_grad():
            reward = hf(torch.tensor([tokenizer.encode(TEXTS[0])])).logits[0]
        assert pooled["data"][0]["data"] == pytest.approx(reward.tolist(), abs=1e-5)


def test_an_embedder_server_reranks_by_cosine_similarity(qwen3):
    hf, folder = qwen3
    with RunningServer(tiny_config(folder, task="embed", max_num_batched_tokens=64)) as server:
        tokenizer = server.async_engine.input_processor.tokenizer
        query = last_token_embedding(hf, tokenizer.encode(QUERY))
        expected = [torch.dot(query, last_token_embedding(hf, tokenizer.encode(d))).item() for d in DOCUMENTS]
        answer = httpx.post(f"{server.base_url}/v1/rerank", timeout=60,
                            json={"query": QUERY, "documents": DOCUMENTS}).json()
        assert [r["index"] for r in answer["results"]] == sorted(range(4), key=lambda i: -expected[i])
        assert [r["relevance_score"] for r in answer["results"]] == \
            pytest.approx(sorted(expected, reverse=True), abs=1e-5)
        # each text embedded once: the query and four documents
        assert answer["usage"]["total_tokens"] == sum(len(tokenizer.encode(t)) for t in [QUERY, *DOCUMENTS])


def test_a_generation_engine_refuses_pooling_requests(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir)) as generating:
        for path, body in [("/v1/embeddings", {"input": "hi"}),
                           ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                           ("/score", {"text_1": "q", "text_2": "d"}), ("/pooling", {"input": "hi"})]:
            response = httpx.post(f"{generating.base_url}{path}", json=body, timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "model" and "--runner pooling" in error["message"]


def test_a_lora_adapter_named_for_pooling_is_a_400_not_ignored():
    from pagedllm.server.embeddings import EmbeddingRequest, check_request
    from pagedllm.server.protocol import APIError

    class ServesAnAdapter:  # what Api._check_model answers for an adapter's name
        def _check_model(self, body):
            return object()

    with pytest.raises(APIError, match="'adapter' is a LoRA adapter") as caught:
        check_request(ServesAnAdapter(), EmbeddingRequest(model="adapter", input="hi"), "embd-1")
    assert caught.value.param == "model" and caught.value.status_code == 400


def test_a_request_the_engine_ends_without_a_vector_is_a_503(monkeypatch):
    """At shutdown the core aborts what is left: an abort, not a vector, comes back."""
    import asyncio

    from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from pagedllm.server import embeddings
    from pagedllm.server.protocol import APIError

    aborted = RequestOutput("embd-1-0", "hi", [104, 105], [CompletionOutput(0, "", [], "abort")], True,
                            RequestMetrics(0.0))

    class Starts:
        async def _start(self, requests):
            return []

    async def collect(streams, raw):
        return [aborted]

    monkeypatch.setattr(embeddings, "collect_or_abort", collect)
    with pytest.raises(APIError, match="before its vector was ready") as caught:
        asyncio.run(embeddings.run_pooling(Starts(), None, []))
    assert caught.value.status_code == 503


def test_more_prompts_than_the_server_ever_queues_is_a_400_not_a_503():
    from types import SimpleNamespace

    from pagedllm.pooling_params import PoolingParams
    from pagedllm.server.embeddings import process_pooling
    from pagedllm.server.protocol import APIError

    api = SimpleNamespace(engine=SimpleNamespace(max_waiting_requests=2))
    with pytest.raises(APIError, match="makes 3 prompts; this server queues at most 2") as caught:
        process_pooling(api, "embd-1", ["a", "b", "c"], PoolingParams(), "input")
    assert caught.value.param == "input" and caught.value.status_code == 400
