import math

import torch

from pagedllm.bench.perplexity import heldout_text, perplexity
from pagedllm.kernels.attention import allocate_kv_cache
from pagedllm.model.loader import load_model
from tests.model.tiny import make_hf_model, save_checkpoint


def _pair(tmp_path):
    hf_model = make_hf_model("llama_gqa_untied")
    ours = load_model(save_checkpoint(hf_model, tmp_path), "float32").model
    return ours, hf_model


def _caches(model, num_blocks: int, block_size: int):
    c = model.config
    return allocate_kv_cache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                             c.head_dim, torch.float32)


def test_perplexity_equals_a_dense_forward_of_transformers(tmp_path):
    ours, theirs = _pair(tmp_path)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = theirs(ids[None]).logits[0].float()
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).mean().item()
    # Chunks of 16 through blocks of 4: every chunk after the first reads cached K/V.
    result = perplexity(ours, _caches(ours, 32, 4), 4, ids.tolist(), context_len=64, chunk_len=16)
    assert result.num_scored_tokens == 59
    assert math.isclose(result.mean_nll, nll, rel_tol=1e-4)
    assert math.isclose(result.perplexity, math.exp(nll), rel_tol=1e-4)


def test_windows_score_each_token_but_the_first_of_each_window(tmp_path):
    ours, _ = _pair(tmp_path)
    result = perplexity(ours, _caches(ours, 16, 4), 4, list(range(1, 101)), context_len=40, chunk_len=8)
    assert result.num_scored_tokens == 39 + 39 + 19


def test_heldout_text_is_english_prose_unlike_the_bench_corpus():
    text = heldout_text()
    assert len(text.split()) > 5000 and "GENERAL PUBLIC LICENSE" in text
