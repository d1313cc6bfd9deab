"""Priority scheduling through the engine on the tiny random model in float32 (issue 37): a stream of
priority-0 requests arriving behind 32 running priority-10 requests in a tight KV cache gets each
first token in the step it arrives (preempting for it), and every request, preempted or not, ends
with the text it has alone. Offline LLM.generate takes one priority per prompt; fcfs refuses one."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.input_processor import InvalidInput
from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matmuls are too small to share among threads on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


LOW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(model=str(model_dir), dtype="float32", block_size=16,
                     **{"num_kv_blocks": 64, "max_num_seqs": 64, **kwargs})


def prompt(i: int) -> list[int]:
    return [(7 * i + k) % 200 + 3 for k in range(8)]


def solo_ids(model_dir, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    roomy = engine(model_dir)
    outputs = []
    for i, p in enumerate(prompts):  # one at a time: each alone in the engine
        roomy.add_request(f"solo{i}", p, params)
        while roomy.has_unfinished_requests():
            outputs += [o for o in roomy.step() if o.finished]
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_stream_of_priority_0_runs_at_once_behind_32_running_priority_10(tiny_model_dir):
    # 66 blocks of 16: 32 requests of 8 + 24 tokens need 64 once they pass 16 tokens.
    tight = engine(tiny_model_dir, num_kv_blocks=66, scheduling_policy="priority",
                   enable_prefix_caching=False)
    low_prompts, high_prompts = [prompt(i) for i in range(32)], [prompt(100 + i) for i in range(8)]
    for i, p in enumerate(low_prompts):
        tight.add_request(f"low{i}", p, LOW, priority=10)
    finished = {}
    for _ in range(10):  # all 32 running, each past its first block
        finished.update((o.request_id, o) for o in tight.step() if o.finished)
    assert tight.stats().num_running == 32 and tight.stats().kv.num_free_blocks == 2
    preempting_steps = 0
    for i, p in enumerate(high_prompts):  # one a step
        tight.add_request(f"high{i}", p, HIGH, priority=0)
        preemptions_before = tight.stats().num_preemptions
        outputs = {o.request_id: o for o in tight.step()}
        # Its first token in the step it arrived, whether that step had to preempt for it or not.
        assert len(outputs[f"high{i}"].outputs[0].token_ids) == 1
        preempting_steps += tight.stats().num_preemptions > preemptions_before
        finished.update((rid, o) for rid, o in outputs.items() if o.finished)
    assert preempting_steps >= 2  # 2 blocks were free: from the third on, someone had to go
    while tight.has_unfinished_requests():
        finished.update((o.request_id, o) for o in tight.step() if o.finished)
    preempted = [rid for rid, o in finished.items() if o.metrics.num_preemptions]
    assert preempted and all(rid.startswith("low") for rid in preempted)
    assert [list(finished[f"low{i}"].outputs[0].token_ids) for i in range(32)] == \
        solo_ids(tiny_model_dir, low_prompts, LOW)
    assert [list(finished[f"high{i}"].outputs[0].token_ids) for i in range(8)] == \
        solo_ids(tiny_model_dir, high_prompts, HIGH)


def test_offline_generate_runs_the_best_priority_first(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=1,
              scheduling_policy="priority")
    outputs = llm.generate([prompt(i) for i in range(4)], HIGH, use_tqdm=False, priority=[5, 0, 9, -1])
    order = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert order == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([prompt(0), prompt(1)], HIGH, use_tqdm=False, priority=[0])


def test_fcfs_refuses_a_priority_naming_the_flag(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16, num_kv_blocks=64)
    with pytest.raises(InvalidInput, match="needs --scheduling-policy priority") as caught:
        llm.generate([prompt(0), prompt(1)], HIGH, use_tqdm=False, priority=[0, 1])
    assert caught.value.param == "priority"
    assert not llm.engine.has_unfinished_requests()  # the first prompt's request was taken back
    assert len(llm.generate([prompt(0)], HIGH, use_tqdm=False, priority=[0])) == 1
