"""Our model's logits against transformers' on the same tiny random weights (float32).

Each shape runs three ways through the paged cache (block size 4, physical blocks shuffled):
one full prefill, token by token, and batches that mix a prefill chunk after cached context
with other sequences' decodes. The reference is transformers fed the same chunks through its
own KV cache (for dynamic rope the chunking changes the result, in both).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import load_model
from tests.model.paged import PagedSequences
from tests.model.tiny import GGUF_OVERRIDES, SHAPES, make_hf_model, save_checkpoint, write_gguf

TOLERANCE = 1e-4
BLOCK_SIZE = 4


def token_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(258) for _ in range(length)]


@torch.inference_mode()
def hf_chunked_logits(hf_model, ids: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    past, logits, start = None, [], 0
    for size in chunk_sizes:
        out = hf_model(torch.tensor([ids[start:start + size]]), past_key_values=past,
                       use_cache=True)
        past, start = out.past_key_values, start + size
        logits.append(out.logits[0])
    return torch.cat(logits)


def assert_logits_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    worst = (ours - expected).abs().max().item()
    assert worst <= TOLERANCE, f"max abs logit difference {worst:.2e} > {TOLERANCE}"


# Hybrid models keep recurrent state pages this harness does not hand out: tests/model/test_hybrid.py
# checks them against transformers through the engine.
@pytest.fixture(scope="module", params=sorted(s for s in SHAPES if not s.endswith("_hybrid")))
def pair(request, tiny_checkpoint):
    """(our model, transformers' model) on the same weights, one shape at a time."""
    checkpoint = tiny_checkpoint(request.param)
    return load_model(checkpoint.folder, dtype="float32").model, checkpoint.hf_model


def test_prefill(pair):
    model, hf_model = pair
    ids = token_ids(24, seed=1)
    ours = PagedSequences(model, num_blocks=8, block_size=BLOCK_SIZE).step({0: ids})[0]
    assert ours.dtype == torch.float32
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [len(ids)]))


def test_token_by_token(pair):
    model, hf_model = pair
    ids = token_ids(22, seed=2)
    paged = PagedSequences(model, num_blocks=8, block_size=BLOCK_SIZE, seed=3)
    ours = torch.cat([paged.step({0: [token]})[0] for token in ids])
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [1] * len(ids)))


def test_mixed_batches_of_chunks_and_decodes(pair):
    model, hf_model = pair
    sequences = {0: token_ids(22, seed=4), 1: token_ids(12, seed=5), 2: token_ids(16, seed=6)}
    # Tokens each sequence computes at each step (0: not scheduled that step).
    schedule = {0: [10, 8, 1, 3], 1: [5, 1, 1, 5], 2: [1, 1, 14, 0]}
    paged = PagedSequences(model, num_blocks=20, block_size=BLOCK_SIZE, seed=7)
    done = dict.fromkeys(sequences, 0)
    ours: dict[int, list[torch.Tensor]] = {seq: [] for seq in sequences}
    for step in range(4):
        batch = {}
        for seq, ids in sequences.items():
            size = schedule[seq][step]
            if size:
                batch[seq] = ids[done[seq]:done[seq] + size]
                done[seq] += size
        for seq, logits in paged.step(batch).items():
            ours[seq].append(logits)
    for seq, ids in sequences.items():
        chunks = [size for size in schedule[seq] if size]
        assert_logits_close(torch.cat(ours[seq]), hf_chunked_logits(hf_model, ids, chunks))


def test_sharded_checkpoint(tmp_path):
    hf_model = make_hf_model("llama_gqa_untied", seed=11)
    folder = save_checkpoint(hf_model, tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    model = load_model(folder, dtype="float32").model
    ids = token_ids(12, seed=12)
    ours = PagedSequences(model, num_blocks=4, block_size=BLOCK_SIZE).step({0: ids})[0]
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [len(ids)]))


@pytest.mark.parametrize("shape", ["llama_gqa_untied", "qwen2_qkv_bias", "qwen3_qk_norm",
                                   "gemma2_softcap_window", "gemma3_local_rope",
                                   "phi3_longrope_window", "phi4_partial_rotary", "qwen3_moe",
                                   "qwen2_moe", "mixtral_moe", "gpt_oss", "deepseek_v2_mla",
                                   "deepseek_v3_mla"])
def test_gguf_written_like_llama_cpp(shape, tmp_path):
    # What llama.cpp's converter changes (Llama's q/k row order, Gemma's norms stored as 1 + w,
    # Phi-3's fused names and rope factor tensors, keys it leaves out) the loader must undo.
    # GGUF has no key for Gemma's query_pre_attn_scalar: llama.cpp takes head_dim, as every Gemma
    # but the 27B ones has it.
    # DeepSeek's kv_b_proj comes split in two (attn_k_b transposed, attn_v_b), its router's
    # gating function, groups and bias under llama.cpp's names.
    overrides = {"query_pre_attn_scalar": 16} if shape.startswith("gemma") else GGUF_OVERRIDES.get(shape, {})
    hf_model = make_hf_model(shape, seed=13, **overrides)
    loaded = load_model(write_gguf(hf_model, tmp_path / "tiny.gguf"), dtype="float32")
    assert loaded.config.architecture == type(hf_model).__name__
    assert loaded.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    ids = token_ids(22, seed=14)
    paged = PagedSequences(loaded.model, num_blocks=12, block_size=BLOCK_SIZE)
    ours = torch.cat([paged.step({0: ids[:12]})[0], paged.step({0: ids[12:]})[0]])
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [12, 10]))


def test_deepseek_gguf_with_kv_b_whole(tmp_path):
    # Files from before llama.cpp split kv_b_proj hold it whole, as attn_kv_b.
    hf_model = make_hf_model("deepseek_v2_mla", seed=13)
    path = write_gguf(hf_model, tmp_path / "kv_b.gguf", split_kv_b=False)
    loaded = load_model(path, dtype="float32")
    ids = token_ids(10, seed=14)
    ours = PagedSequences(loaded.model, num_blocks=6, block_size=BLOCK_SIZE).step({0: ids})[0]
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [len(ids)]))


def test_bfloat16_runs_close_to_float32(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama_gqa_untied")
    model = load_model(checkpoint.folder, dtype="bf16").model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ids = token_ids(10, seed=15)
    ours = PagedSequences(model, num_blocks=4, block_size=BLOCK_SIZE).step({0: ids})[0]
    assert ours.dtype == torch.float32
    expected = hf_chunked_logits(checkpoint.hf_model, ids, [len(ids)])
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()


# Prompt lengths per shape, with 24 tokens a step: the 20-token prompt's prefill is cut in two.
# A LongRoPE model's sequences stay on one side of its original length (16) from their first
# chunk on (3 + 12, 4 + 12 tokens; 20 from a first chunk of 17): transformers' generate
# recomputes the cache with the long factors when a sequence crosses that length, where ours
# keeps the keys already computed, as transformers' forward does.
ENGINE_PROMPTS = {"qwen3_qk_norm": (13, 3, 20), "gemma2_softcap_window": (13, 3, 20),
                  "gemma3_local_rope": (13, 3, 20), "phi3_longrope_window": (3, 4, 20),
                  "phi4_partial_rotary": (13, 3, 20)}


@pytest.mark.parametrize("shape", sorted(ENGINE_PROMPTS))
def test_engine_greedy_matches_transformers(shape, tiny_checkpoint):
    """The whole engine (paged blocks of 4, prefills cut into chunks beside other requests'
    decodes) generates transformers' greedy tokens."""
    checkpoint = tiny_checkpoint(shape)
    llm = LLM(model=str(checkpoint.folder), dtype="float32", block_size=4, max_model_len=64,
              kv_cache_memory="1MiB", max_num_batched_tokens=24)
    prompts = [token_ids(length, seed=20 + length) for length in ENGINE_PROMPTS[shape]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        expected = checkpoint.hf_model.generate(  # no eos ids: as ignore_eos
            ids, eos_token_id=[], pad_token_id=0, max_new_tokens=12, do_sample=False,
            attention_mask=torch.ones_like(ids))
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()
