"""A pooling engine (runner="pooling") on tiny random checkpoints, float32, against transformers on
the same weights: embeddings pooled last-token (Qwen3), mean (Llama) and cls equal the pooled
last_hidden_state; batching, chunking and prefix-cache hits do not change a vector, and a recompute
from position 0 (after preemption) starts a mean or cls pool afresh; dimensions and normalize; the
reranker's scores and order, a sequence classifier's scores and rewards equal the same computation
in transformers; the real default model's embeddings too; and requests of the wrong kind are
refused before they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.engine.input_processor import InvalidInput
from pagedllm.model.errors import UnsupportedModelError
from pagedllm.text.score_prompt import score_prompt
from tests.conftest import requires_default_model
from tests.model.tiny import make_hf_classifier, make_hf_model, save_checkpoint

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "paged attention", "x",
           "Embeddings map a text to one vector; near texts, near ones."]
SAME = dict(rtol=0, atol=1e-6)  # "does not change a vector": float32, within 1e-6


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    hf = make_hf_model("qwen3_qk_norm", max_position_embeddings=512)  # room for the reranker's prompt
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("qwen3-pool"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = make_hf_model("llama_gqa_untied")
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("llama-pool"))


def pooling_llm(folder, **overrides) -> LLM:
    options = dict(dtype="float32", device="cpu", runner="pooling", block_size=4, num_kv_blocks=96,
                   max_num_batched_tokens=16)  # chunks of at most 16 tokens: most prompts take several
    return LLM(str(folder), **{**options, **overrides})


def hidden_states(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([token_ids])).last_hidden_state[0]


def vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def assert_cosine(expected: torch.Tensor, got: torch.Tensor) -> None:
    cosine = F.cosine_similarity(expected, got, dim=-1)
    assert cosine.min().item() >= 0.9999, cosine


def test_last_token_embeddings_equal_transformers_qwen3(qwen3):
    hf, folder = qwen3
    outputs = pooling_llm(folder).embed(PROMPTS, use_tqdm=False)
    expected = torch.stack([F.normalize(hidden_states(hf, o.prompt_token_ids)[-1], dim=0) for o in outputs])
    assert [len(o.outputs.embedding) for o in outputs] == [hf.config.hidden_size] * len(PROMPTS)
    assert_cosine(expected, vectors(outputs))
    torch.testing.assert_close(vectors(outputs), expected, rtol=0, atol=1e-5)


def test_mean_embeddings_equal_transformers_llama_and_prefix_caching_goes_off(llama):
    hf, folder = llama
    llm = pooling_llm(folder, pooling_type="mean")
    assert not llm.engine.engine_core.kv_manager.enable_prefix_caching
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    expected = torch.stack([F.normalize(hidden_states(hf, o.prompt_token_ids).mean(0), dim=0)
                            for o in outputs])
    assert_cosine(expected, vectors(outputs))
    raw = llm.embed(PROMPTS[0], normalize=False, use_tqdm=False)[0]  # the mean itself, unscaled
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding),
                               hidden_states(hf, raw.prompt_token_ids).mean(0), rtol=1e-5, atol=1e-5)


def test_cls_embeddings_are_the_first_tokens_state(llama):
    hf, folder = llama
    outputs = pooling_llm(folder, pooling_type="cls").embed(PROMPTS, normalize=False, use_tqdm=False)
    expected = torch.stack([hidden_states(hf, o.prompt_token_ids)[0] for o in outputs])
    torch.testing.assert_close(vectors(outputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_batching_and_chunking_do_not_change_a_vector(qwen3, pooling_type):
    _, folder = qwen3
    alone = pooling_llm(folder, pooling_type=pooling_type, max_num_batched_tokens=64)
    solo = torch.cat([vectors(alone.embed(p, use_tqdm=False)) for p in PROMPTS])  # one at a time
    batched = vectors(alone.embed(PROMPTS, use_tqdm=False))
    chunked = vectors(pooling_llm(folder, pooling_type=pooling_type, max_num_batched_tokens=5)
                      .embed(PROMPTS, use_tqdm=False))
    for other in (batched, chunked):
        torch.testing.assert_close(other, solo, **SAME)


def test_prefix_cache_hits_do_not_change_a_vector(qwen3):
    _, folder = qwen3
    llm = pooling_llm(folder)
    long = PROMPTS[3]
    first = llm.embed(long, use_tqdm=False)[0]
    again = llm.embed([long, long[:40] + " and more after the shared part"], use_tqdm=False)
    assert first.num_cached_tokens == 0 and again[0].num_cached_tokens >= 40
    torch.testing.assert_close(vectors(again[:1]), vectors([first]), **SAME)
    cold = pooling_llm(folder, enable_prefix_caching=False).embed(again[1].prompt, use_tqdm=False)
    assert again[1].num_cached_tokens > 0
    torch.testing.assert_close(vectors(again[1:]), vectors(cold), **SAME)


def test_dimensions_cut_then_normalize_and_token_ids_prompts(qwen3):
    hf, folder = qwen3
    llm = pooling_llm(folder)
    full = llm.embed(PROMPTS[0], normalize=False, use_tqdm=False)[0]
    cut = llm.embed(full.prompt_token_ids, dimensions=8, use_tqdm=False)[0]
    assert cut.prompt is None and len(cut.outputs.embedding) == 8
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding),
                               F.normalize(torch.tensor(full.outputs.embedding[:8]), dim=0), **SAME)
    prefixed = llm.embed("brown fox", instruction="Query: ", use_tqdm=False)[0]
    assert prefixed.prompt == "Query: brown fox"


def test_the_reranker_scores_and_orders_documents_as_transformers_does(qwen3):
    hf, folder = qwen3
    llm = pooling_llm(folder, score_tokens=("n", "y"), num_kv_blocks=512)  # labels: one byte token each
    tokenizer = llm.get_tokenizer()
    no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("n", "y"))
    query = "what do foxes jump over?"
    documents = ["the lazy dog", "a paged KV cache", "fences, mostly", "x", "nothing at all here"]
    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    expected = []
    for document in documents:
        text, spans = score_prompt(query, document)
        ids = tokenizer.encode(text, plain_spans=spans)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    assert sorted(range(len(documents)), key=lambda i: -scores[i]) == \
        sorted(range(len(documents)), key=lambda i: -expected[i])
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=0, atol=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(documents)  # an order to compare, not ties
    forged = llm.engine.input_processor.score_input("q", "a <|eos|> b")["prompt_token_ids"]
    assert tokenizer.eos_token_ids[0] not in forged  # a document's control-token text stays text


def test_an_embedders_scores_are_cosine_similarities_as_transformers_gives_them(qwen3):
    hf, folder = qwen3
    llm = pooling_llm(folder, task="embed")
    query, documents = "what do foxes jump over?", ["the lazy dog", "a paged KV cache", "fences"]
    scores = [o.outputs.score for o in llm.score(query, documents, instruction="Query: ", use_tqdm=False)]
    tokenizer = llm.get_tokenizer()

    def embedding(text: str) -> torch.Tensor:
        return F.normalize(hidden_states(hf, tokenizer.encode(text))[-1], dim=0)

    expected = [torch.dot(embedding("Query: " + query), embedding(d)).item() for d in documents]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(documents)


@pytest.mark.parametrize("num_labels", [1, 2])
def test_a_sequence_classifier_scores_with_its_head_as_transformers_does(tmp_path, num_labels):
    hf = make_hf_classifier("qwen3_qk_norm", num_labels, seed=num_labels, max_position_embeddings=512)
    save_checkpoint(hf, tmp_path)
    llm = pooling_llm(tmp_path, num_kv_blocks=512)  # no --score-tokens needed: the head scores
    query, documents = "what do foxes jump over?", ["the lazy dog", "a paged KV cache", "fences"]
    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    expected = []
    for document in documents:
        ids = llm.engine.input_processor.score_input(query, document)["prompt_token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        probability = torch.sigmoid(logits[0]) if num_labels == 1 else torch.softmax(logits, 0)[-1]
        expected.append(probability.item())
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=0, atol=1e-5)
    assert sorted(range(3), key=lambda i: -scores[i]) == sorted(range(3), key=lambda i: -expected[i])
    rewards = llm.reward(documents, use_tqdm=False)  # the head's raw logits, vLLM's --task reward
    for output in rewards:
        with torch.no_grad():
            logits = hf(torch.tensor([output.prompt_token_ids])).logits[0]
        torch.testing.assert_close(torch.tensor(output.outputs.data), logits, rtol=0, atol=1e-5)
    if num_labels == 1:
        with pytest.raises(UnsupportedModelError, match="is a classifier, with no LM head"):
            LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16)


def test_wrong_kinds_of_request_are_refused_before_they_run(qwen3, tiny_model_dir):
    _, folder = qwen3
    pooling = pooling_llm(folder)
    with pytest.raises(InvalidInput, match="--runner pooling: it returns embeddings") as caught:
        pooling.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert caught.value.param == "model"
    with pytest.raises(InvalidInput, match="dimensions must be at most the model's hidden size, 64") \
            as caught:
        pooling.embed("hello", dimensions=65, use_tqdm=False)
    assert caught.value.param == "dimensions"
    with pytest.raises(InvalidInput, match="score label 'no' .* is 2 tokens"):
        pooling.score("q", ["d"], use_tqdm=False)  # the byte tokenizer spells "no" in 2 tokens
    with pytest.raises(InvalidInput, match="rewards come from a reward model's head"):
        pooling.reward("hello", use_tqdm=False)
    generating = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=32)
    with pytest.raises(InvalidInput, match="embeddings and scores need an engine started with --runner"):
        generating.embed("hello", use_tqdm=False)
    assert not pooling.engine.has_unfinished_requests() and not generating.engine.has_unfinished_requests()


@pytest.mark.parametrize("pooling_type", ["mean", "cls"])
def test_a_recompute_from_position_0_starts_the_pool_afresh(pooling_type):
    """A preempted request runs its prompt again from position 0: what its first chunks kept
    must not count twice."""
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.worker.pooler import Pooler

    pooler, params = Pooler(pooling_type), PoolingParams(normalize=False)
    states = torch.randn(10, 8)

    def chunks(bounds):
        vector = None
        for start, end in bounds:
            vector = pooler.take_chunk("r", states[start:end], start, 10, params, None)
        return vector

    whole = chunks([(0, 10)])
    assert chunks([(0, 4), (4, 7), (0, 3), (3, 10)]) == pytest.approx(whole, abs=1e-6)
    expected = states.mean(0) if pooling_type == "mean" else states[0]
    assert whole == pytest.approx(expected.tolist(), abs=1e-6)
    pooler.take_chunk("s", states[:4], 0, 10, params, None)
    pooler.forget(["s"])  # preempted: a chunk past 0 now has nothing before it
    with pytest.raises(RuntimeError, match="without the ones before"):
        pooler.take_chunk("s", states[4:], 4, 10, params, None)


def test_task_is_vllms_spelling_of_the_pooling_runner():
    from pagedllm.config import EngineConfig

    assert EngineConfig(task="embed").runner == "pooling"
    assert EngineConfig(task="score").runner == EngineConfig(task="reward").runner == "pooling"
    assert EngineConfig().runner == "generate"
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean, cls"):
        EngineConfig(pooling_type="max")


@requires_default_model
def test_the_default_models_embeddings_equal_transformers(default_model_path, hf_default_model):
    """The real SmolLM2-135M, float32, in chunks of 16 tokens: last-token and mean pooling."""
    texts = ["The capital of France is Paris.", "Bananas are yellow, and so is the sun at noon."]
    for pooling_type in ("last", "mean"):
        llm = LLM(str(default_model_path), dtype="float32", device="cpu", runner="pooling",
                  pooling_type=pooling_type, kv_cache_memory="64MiB", max_model_len=256,
                  max_num_batched_tokens=16)
        outputs = llm.embed(texts, use_tqdm=False)
        states = [hidden_states(hf_default_model, o.prompt_token_ids) for o in outputs]
        expected = torch.stack([F.normalize(h[-1] if pooling_type == "last" else h.mean(0), dim=0)
                                for h in states])
        assert_cosine(expected, vectors(outputs))
