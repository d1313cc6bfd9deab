"""`bench memory --families`: the figures are the engine's own plan (checked against engines of
tiny models of each family), and MLA's bytes per token are the latent's."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.memory_families import FAMILY_SHAPES, family_figures, main
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import read_model_config


@pytest.mark.parametrize("shape", ["llama_gqa_untied", "qwen3_5_hybrid", "granite4_hybrid",
                                   "deepseek_v2_mla"])
def test_figures_are_what_the_engine_plans(shape, tmp_path):
    pytest.importorskip("transformers")
    from tests.model.tiny import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(shape), tmp_path)
    figures = family_figures(read_model_config(folder), "1MiB", 64, 4, torch.float32)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, kv_cache_memory="1MiB", max_model_len=64)
    plan, stats = llm.engine.kv_plan, llm.memory_stats()
    assert figures["bytes_per_token"] == stats["bytes_per_token"] == plan.bytes_per_block // 4
    assert figures["num_blocks"] == stats["num_blocks"] == plan.num_blocks
    assert figures["state_pages_per_request"] == stats["state_pages_per_request"]
    assert figures["requests_at_once"] == plan.num_blocks // plan.blocks_per_request
    assert figures["kv_kind"] == plan.kv_kind
    hybrid = shape in ("qwen3_5_hybrid", "granite4_hybrid")
    assert (figures["state_bytes_per_request"] > 0) == hybrid == (figures["kv_layers"] < figures["layers"])
    # That many requests of max_model_len run at once in the planned pool, and every page frees.
    n = figures["requests_at_once"]
    params = SamplingParams(temperature=0, max_tokens=64 - 8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 9))}] * n, params, use_tqdm=False)
    assert llm.memory_stats()["num_preemptions"] == 0
    assert llm.memory_stats()["num_free_blocks"] == plan.num_blocks


def test_mla_costs_its_latent_per_token_and_holds_the_most_requests(capsys, tmp_path):
    out = tmp_path / "families.json"
    main(argparse.Namespace(kv_cache_memory=None, max_model_len=None, dtype="auto", block_size=16,
                            model=None, output_json=str(out)))
    payload = json.loads(out.read_text())
    assert payload["kv_budget_bytes"] == 2**30 and payload["max_model_len"] == 1024
    rows = payload["families"]
    # bfloat16: keys and values per KV head of each attention layer (a hybrid's 7 of 28), against
    # MLA's one latent + rotary key per layer.
    for name in ("gqa", "hybrid-deltanet", "hybrid-mamba2"):
        config = ModelConfig.from_hf_config(FAMILY_SHAPES[name][1])
        kv_layers = 28 if name == "gqa" else 7
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        assert rows[name]["bytes_per_token"] == kv_layers * 2 * kv_heads * head_dim * 2
        assert (rows[name]["state_bytes_per_request"] > 0) == (name != "gqa")
    mla = FAMILY_SHAPES["mla"][1]
    assert rows["mla"]["bytes_per_token"] == 28 * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"]) * 2
    assert rows["mla"]["kv_kind"] == "mla_latent"
    assert rows["mla"]["requests_at_once"] > rows["hybrid-deltanet"]["requests_at_once"] > \
        rows["gqa"]["requests_at_once"] > 0
    # Shapes of about one size: the attention is what differs.
    assert all(1.5e9 < r["parameters"] < 2.1e9 for r in rows.values())
    assert "requests at once" in capsys.readouterr().out


def test_a_family_whose_request_does_not_fit_holds_none(tmp_path):
    # At 32k tokens one GQA request needs 3.5 GiB: none fit in 1 GiB, the plan's reason is kept.
    out = tmp_path / "families.json"
    main(argparse.Namespace(kv_cache_memory="1GiB", max_model_len=32768, dtype="auto", block_size=16,
                            model=None, output_json=str(out)))
    rows = json.loads(out.read_text())["families"]
    assert rows["gqa"]["requests_at_once"] == 0 and "raise kv_cache_memory" in rows["gqa"]["does_not_fit"]
    assert rows["gqa"]["bytes_per_token"] == 28 * 2 * 8 * 128 * 2
    assert rows["mla"]["requests_at_once"] == 1 and rows["hybrid-deltanet"]["requests_at_once"] == 2
