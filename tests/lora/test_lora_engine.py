"""LoRA through the whole engine (LLM.generate): requests of several adapters and of the base
model share each step, and each one's greedy tokens equal transformers with PEFT's merged weights
for its adapter (float32), through prefix caching and preemption; the prefix cache serves a
request only blocks computed under its own adapter."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import greedy_reference, make_adapter
from tests.model.tiny import make_hf_model, save_checkpoint

pytest.importorskip("peft")

ADAPTERS = {  # name -> (targets, rank, rslora)
    "attn": (["q_proj", "v_proj", "o_proj"], 4, False),
    "mlp": (["gate_proj", "up_proj", "down_proj", "k_proj"], 8, True),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
             "lm_head"], 8, False),
}
NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """The base's folder, {name: LoRARequest}, and {name or None: the merged transformers model}."""
    root = tmp_path_factory.mktemp("lora_engine")
    base = save_checkpoint(make_hf_model("llama_gqa_untied", seed=5), root / "base")
    requests, references = {}, {None: make_hf_model("llama_gqa_untied", seed=5).eval()}
    for i, (name, (targets, rank, rslora)) in enumerate(ADAPTERS.items()):
        folder, merged = make_adapter(make_hf_model("llama_gqa_untied", seed=5), root / name, targets,
                                      rank, rslora, seed=20 + i)
        requests[name] = LoRARequest(name, i + 1, str(folder))
        references[name] = merged.eval()
    return base, requests, references


def prompts_and_adapters(seed: int, count: int) -> tuple[list[list[int]], list[str | None]]:
    """Prompts sharing an 8-token prefix (two blocks of 4), each with an adapter or the base."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(8)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(2, 9))] for _ in range(count)]
    adapters = [[None, "attn", "mlp", "all"][i % 4] for i in range(count)]
    return prompts, adapters


def run(llm: LLM, requests: dict, prompts, adapters):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=[requests[a] if a else None for a in adapters])
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs]


def expected(references, prompts, adapters):
    return [greedy_reference(references[a], p, NUM_TOKENS) for p, a in zip(prompts, adapters)]


def test_adapters_and_the_base_in_one_batch_match_peft_merged(lora_setup):
    base, requests, references = lora_setup
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, block_size=4,
              num_kv_blocks=128)
    prompts, adapters = prompts_and_adapters(1, 8)
    want = expected(references, prompts, adapters)
    tokens, _ = run(llm, requests, prompts, adapters)
    assert tokens == want
    # Again: every request's shared prefix now comes from the cache, its own adapter's blocks.
    tokens, cached = run(llm, requests, prompts, adapters)
    assert tokens == want and all(n >= 8 for n in cached)
    assert llm.memory_stats()["num_used_blocks"] == 0


def test_through_preemption(lora_setup):
    base, requests, references = lora_setup
    # 12 blocks of 4 tokens cannot hold 8 requests of 18-24 tokens at once.
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, block_size=4,
              num_kv_blocks=12, max_model_len=32)
    prompts, adapters = prompts_and_adapters(2, 8)
    tokens, _ = run(llm, requests, prompts, adapters)
    assert tokens == expected(references, prompts, adapters)
    assert llm.memory_stats()["num_preemptions"] > 0


def test_more_adapters_than_slots_take_turns(lora_setup):
    """One slot, three adapters and the base: each adapter's requests wait for the slot until the
    ones before them finished, the base's run meanwhile."""
    base, requests, references = lora_setup
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
              block_size=4, num_kv_blocks=128)
    prompts, adapters = prompts_and_adapters(4, 8)
    tokens, _ = run(llm, requests, prompts, adapters)
    assert tokens == expected(references, prompts, adapters)
    core = llm.engine.engine_core
    assert core.lora.num_waiting == 0 and core.lora.slots.num_read == 2
    assert llm.memory_stats()["num_used_blocks"] == 0


def test_a_request_is_served_only_its_own_adapters_blocks(lora_setup):
    base, requests, references = lora_setup
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, block_size=4,
              num_kv_blocks=64)
    prompt = prompts_and_adapters(3, 1)[0][0]  # two full blocks and more
    manager = llm.engine.engine_core.kv_manager
    blocks = {}
    for name in ("attn", None, "mlp"):
        tokens, (cached,) = run(llm, requests, [prompt], [name])
        assert cached == 0  # nothing cached under this adapter (or the base) yet
        assert tokens == expected(references, [prompt], [name])
        key = requests[name].key if name else None
        blocks[name] = [b.block_id for b in manager.pool.blocks if b.is_cached and b.cache_parent is None
                        and b.cache_salt == (None if key is None else (None, key))]
    assert len({tuple(ids) for ids in blocks.values()}) == 3 and all(len(ids) == 1 for ids in blocks.values())
    for name in ("attn", None, "mlp"):  # each finds its own first block again, by id
        tokens, (cached,) = run(llm, requests, [prompt], [name])
        assert cached >= 8 and tokens == expected(references, [prompt], [name])


def test_lora_off_or_a_bad_adapter_is_refused_in_one_line(lora_setup, tmp_path):
    base, requests, _ = lora_setup
    plain = LLM(str(base), dtype="float32", block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match="'attn' asked for, but LoRA is off"):
        plain.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=requests["attn"])
    small = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4, block_size=4,
                num_kv_blocks=16)
    with pytest.raises(ValueError, match="'mlp': rank 8 exceeds --max-lora-rank 4"):
        small.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=requests["mlp"])
    missing = LoRARequest("gone", 9, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="'gone': .* has no adapter_config.json"):
        small.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=missing)
    assert small.memory_stats()["num_used_blocks"] == 0


@torch.inference_mode()
def test_the_request_crosses_the_core_channel():
    from pagedllm.engine.core_channel import AddRequest, Codec, ToCore
    from pagedllm.engine.messages import EngineCoreRequest

    request = EngineCoreRequest("r", [1, 2], SamplingParams(), (0,), 0.0,
                                lora=LoRARequest("a", 3, "/adapters/a"))
    decoded = Codec(ToCore).decode(Codec(ToCore).encode(AddRequest(request)))
    assert decoded.request.lora == LoRARequest("a", 3, "/adapters/a")
