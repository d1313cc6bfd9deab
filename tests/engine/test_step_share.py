"""The token share through the engine (issue 32): a request of several sequences beside another
gives the same greedy tokens with the share on, set or off (only the steps it runs in change);
the core feeds every step's tokens and time to the cost model; the figure reaches memory_stats."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.core.step_cost import StepCost

PROMPTS = ["one two three", "a b c d e f g h"]


def run(tiny_model_dir, step_share_tokens):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, generation_config="none",
              step_share_tokens=step_share_tokens)
    many = SamplingParams(n=6, temperature=0, max_tokens=12, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [many, one], use_tqdm=False)
    return llm, [[c.token_ids for c in o.outputs] for o in outputs]


def test_a_shared_step_gives_the_same_tokens_with_the_share_on_or_off(tiny_model_dir):
    _, off = run(tiny_model_dir, 0)
    llm, on = run(tiny_model_dir, 1)
    assert on == off and len(on[0]) == 6
    stats = llm.memory_stats()
    assert stats["step_share_tokens"] == 1
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_the_core_times_every_step_it_runs(tiny_model_dir, monkeypatch):
    seen = []
    real = StepCost.observe

    def observe(self, num_tokens, seconds):
        seen.append((num_tokens, seconds))
        real(self, num_tokens, seconds)

    monkeypatch.setattr(StepCost, "observe", observe)
    llm, _ = run(tiny_model_dir, None)
    assert len(seen) >= 12 and all(n > 0 and s > 0 for n, s in seen)
    assert {n for n, _ in seen} >= {7}  # the decode steps of 6 + 1 sequences
    assert max(n for n, _ in seen) > 7  # and the prompts' steps
    fitted = StepCost(llm.engine.config.max_num_batched_tokens)
    for num_tokens, seconds in seen:
        real(fitted, num_tokens, seconds)
    assert llm.memory_stats()["step_share_tokens"] == fitted.free_tokens()
