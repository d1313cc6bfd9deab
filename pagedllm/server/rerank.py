"""Scoring over a pooling engine (--runner pooling): /v1/rerank in Cohere's and Jina's shape (a query,
documents, top_n, return_documents; the results best first) and vLLM's /score (text_1 against
text_2: one against many, or pairs). Each (query, document) pair is one "score" pooling request:
the causal reranker's verdict under its prompt format (pagedllm.text.score_prompt), P(positive
label) among --score-tokens, or a classifier's head. On an embedder's engine (--task embed) a
score is the cosine similarity of the two texts' embeddings instead (pagedllm.pooling_score)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import Request
from pydantic import Field

from pagedllm.engine.input_processor import InvalidInput
from pagedllm.pooling_score import similarity_scores, texts_to_embed
from pagedllm.server.embeddings import check_request, pooling_params, process_pooling, run_pooling
from pagedllm.server.protocol import APIError, Bool, Int, Text, _Body

# Documents scored in one request (each is a prompt of its own).
MAX_DOCUMENTS = 1024


class DocumentObject(_Body):
    text: Text


Document = Text | DocumentObject


class RerankRequest(_Body):
    model: Text | None = None
    query: Text
    documents: Annotated[list[Document], Field(max_length=MAX_DOCUMENTS)]
    top_n: Annotated[Int, Field(ge=1)] | None = None  # null: every document
    return_documents: Bool = True
    # pagedllm's: the reranker's task instruction (null: its model card's default)
    instruction: Annotated[str, Field(min_length=1)] | None = None


class ScoreRequest(_Body):
    model: Text | None = None
    text_1: Text | Annotated[list[Text], Field(max_length=MAX_DOCUMENTS)]
    text_2: Text | Annotated[list[Text], Field(max_length=MAX_DOCUMENTS)]
    instruction: Annotated[str, Field(min_length=1)] | None = None


def _text(document: Document) -> str:
    return document if isinstance(document, str) else document.text


async def _scores(api, raw: Request, response_id: str, pairs: list[tuple[str, str]],
                  instruction: str | None, param: str) -> tuple[list[float], int]:
    """Each pair's score, in order, and the prompt tokens they took."""
    setup = api.processor.pooling
    if setup is not None and setup.scores_by_similarity:  # an embedder's engine
        texts = texts_to_embed(pairs, instruction)
        params = pooling_params(api, "embed", normalize=True)
        requests = await api.workers.run(process_pooling, api, response_id, texts, params, param)
        outputs = await run_pooling(api, raw, requests)
        embeddings = {t: o.outputs.data for t, o in zip(texts, outputs)}
        return (similarity_scores(pairs, instruction, embeddings),
                sum(len(o.prompt_token_ids) for o in outputs))
    params = pooling_params(api, "score")

    def prompts():
        try:
            return [api.processor.score_input(q, d, instruction) for q, d in pairs]
        except InvalidInput as exc:
            raise APIError(str(exc), param=param) from exc

    inputs = await api.workers.run(prompts)
    requests = await api.workers.run(process_pooling, api, response_id, inputs, params, param)
    outputs = await run_pooling(api, raw, requests)
    return [o.outputs.data[-1] for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)


async def rerank(api, raw: Request, body: RerankRequest) -> dict:
    response_id = f"rerank-{uuid.uuid4().hex}"
    check_request(api, body, response_id)
    if not body.documents:
        raise APIError("documents must not be empty: give at least one document to rank",
                       param="documents")
    texts = [_text(d) for d in body.documents]
    scores, num_tokens = await _scores(api, raw, response_id, [(body.query, t) for t in texts],
                                       body.instruction, "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": response_id, "model": api.model_name, "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def score(api, raw: Request, body: ScoreRequest) -> dict:
    response_id = f"score-{uuid.uuid4().hex}"
    check_request(api, body, response_id)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not firsts or not seconds:
        raise APIError("text_1 and text_2 must not be empty", param="text_2" if firsts else "text_1")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise APIError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                       "as many as text_2 (pairs)", param="text_1")
    scores, num_tokens = await _scores(api, raw, response_id, list(zip(firsts, seconds)),
                                       body.instruction, "text_2")
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": api.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
