"""The whole path from prompt to text, on the real default model in float32.

Greedy outputs must not change with batch composition, block size or preemption.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.utils import cdiv
from tests.conftest import requires_default_model

pytestmark = requires_default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "import numpy as np\n\nx = np.",
    "The largest planet in the solar system is",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)


def greedy_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.memory_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not llm.engine.has_unfinished_requests()


def test_greedy_is_the_same_alone_and_in_a_batch_of_24_others(llm):
    target = PROMPTS[2]
    alone = greedy_ids(llm, [target])[0]
    others = [f"{p} (variant {i})" for i, p in enumerate(PROMPTS * 3)][:24]
    batch = others[:12] + [target] + others[12:]
    in_batch = greedy_ids(llm, batch)[12]
    assert in_batch == alone
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("block_size", [8, 32])
def test_greedy_is_the_same_for_every_block_size(llm, block_size):
    reference = greedy_ids(llm, PROMPTS[:4])
    other = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, block_size=block_size)
    assert greedy_ids(other, PROMPTS[:4]) == reference


def test_greedy_is_the_same_when_preemption_recomputes(llm):
    prompts = [p + " " + p for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = greedy_ids(llm, prompts, params)
    # 12 blocks of 16 tokens cannot hold 8 requests of ~60 tokens at once.
    tight = LLM(dtype="float32", kv_cache_memory=12 * bytes_per_block(llm, 16), max_model_len=128,
                block_size=16, enable_prefix_caching=False)
    assert greedy_ids(tight, prompts, params) == reference
    assert tight.memory_stats()["num_preemptions"] > 0
    assert_all_blocks_free(tight)


def bytes_per_block(llm: LLM, block_size: int) -> int:
    plan = llm.engine.kv_plan
    return plan.bytes_per_block * block_size // plan.block_size


@pytest.mark.timeout(300)  # loads transformers' copy of the default model first: ~70 s under load
def test_greedy_matches_transformers_on_the_default_model(llm, hf_default_model):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([tokenizer.encode(prompt)])
        expected = hf_default_model.generate(ids, max_new_tokens=16, do_sample=False,
                                             attention_mask=torch.ones_like(ids))
        assert output.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist(), prompt


def test_same_seed_same_sample(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    first = greedy_ids(llm, [PROMPTS[0]], params)[0]
    # in a different batch, with other random requests around it
    batch = [PROMPTS[1], PROMPTS[0], PROMPTS[3]]
    mixed = [SamplingParams(temperature=1.0, max_tokens=8), params, SamplingParams(temperature=0.5)]
    assert llm.generate(batch, mixed, use_tqdm=False)[1].outputs[0].token_ids == first


def test_stop_string_cuts_the_text_exactly(llm):
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[10:14]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_n_gives_that_many_outputs(llm):
    output = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5),
                          use_tqdm=False)[0]
    assert [o.index for o in output.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) > 0 for o in output.outputs)
    assert len({tuple(o.token_ids) for o in output.outputs}) > 1
    assert_all_blocks_free(llm)


def test_logprobs_agree_with_a_log_softmax_of_the_logits(llm, default_model):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0]
    model = default_model.model
    ids = torch.tensor(out.prompt_token_ids)
    logits = _dense_logits(model, ids)
    expected = torch.log_softmax(logits, -1)
    entry = out.outputs[0].logprobs[0]
    token = out.outputs[0].token_ids[0]
    assert math.isclose(entry[token].logprob, expected[token].item(), abs_tol=1e-3)
    assert entry[token].rank == 1
    assert len(entry) == 5
    for token_id, lp in entry.items():
        assert math.isclose(lp.logprob, expected[token_id].item(), abs_tol=1e-3)


def _dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits from a fresh one-request paged forward."""
    from pagedllm.kernels.attention import allocate_kv_cache
    from tests.conftest import build_attn_metadata

    cfg = model.config
    num_blocks = cdiv(len(ids), 16)
    caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, 16, cfg.num_key_value_heads,
                               cfg.head_dim, torch.float32)
    meta, positions = build_attn_metadata([(0, len(ids), list(range(num_blocks)))], 16)
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        return model.compute_logits(hidden[-1:])[0]


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_prompts_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPTS[0], ""], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 5000}, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_abort_frees_every_block(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"abort-{i}", PROMPTS[i], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    for i in range(4):
        assert engine.abort_request(f"abort-{i}")
    engine.step()
    assert_all_blocks_free(llm)


def test_kv_budget_too_small_for_max_model_len_fails_at_start():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(dtype="float32", kv_cache_memory="1MiB", max_model_len=4096)


def test_chat_goes_through_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_cli_generate_names_paris():
    import contextlib
    import io

    from pagedllm.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["generate", "The capital of France is", "--temperature", "0",
                     "--max-tokens", "12", "--kv-cache-memory", "64MiB",
                     "--max-model-len", "512"]) == 0
    assert "Paris" in buffer.getvalue()
