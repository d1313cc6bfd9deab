"""Speculative decoding on the default model in bf16 with --batch-invariant: 50 greedy answers
equal the plain run's token for token. Verification runs a sequence's k + 1 positions as one chunk
where the plain run decodes them one at a time; batch-invariant kernels make a position's result
independent of the chunk and batch it runs in, so greedy speculation is exact in bf16 too."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import load_workload
from pagedllm.kernels import tiers
from tests.conftest import requires_default_model

pytestmark = [requires_default_model, pytest.mark.skipif(
    not tiers.current().runs_layers, reason="batch-invariant mode needs the compiled CPU kernels")]


@pytest.mark.timeout(900)  # 100 bf16 answers in the batch-invariant mode: minutes on 2 busy cores
def test_fifty_bf16_batch_invariant_answers_equal_the_plain_runs():
    torch.set_num_threads(2)
    # Four at a time: a small batch speculates (choose_k turns it off for a large one).
    settings = dict(dtype="bfloat16", batch_invariant=True, kv_cache_memory="256MiB", max_model_len=1024,
                    max_num_seqs=4)
    plain = LLM(**settings)
    work = load_workload(plain.engine.tokenizer, "random", 50, "16-160", "24", 0, "copy")
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in work]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    speculating = LLM(**settings, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = [o.outputs[0].token_ids for o in speculating.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = speculating.memory_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
