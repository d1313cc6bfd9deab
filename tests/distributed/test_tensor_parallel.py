"""Tensor parallelism end to end, with the workers the engine spawns (gloo on the CPU): in float32
the greedy tokens at tensor_parallel_size 2 are those of size 1 (tiny Llama, Qwen2 with q/k/v
bias, Mistral's window, mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE's gated shared expert,
gpt-oss's sinks and biased experts), one KV head replicated on both ranks, quantized GGUF weights,
the default model); preemption, prefix caching, copy-on-write forks, prompt logprobs, a pooling
engine's vectors and scores and aborts go through the workers; a killed or hung worker is a clear
error, never a hang; sizes that do not split are refused before anything starts.

Each engine spawns a worker process (seconds): engines are shared where the tests allow.
"""

from __future__ import annotations

import gc
import os
import signal

import gguf
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.driver import TensorParallelDriver
from pagedllm.distributed.group import TensorParallelError
from pagedllm.engine.core import StepError
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import requires_default_model
from tests.model.test_quantized_model import quantized_gguf
from tests.model.tiny import make_hf_model, save_checkpoint

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "0123456789" * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Small blocks and few of them: a batch of PROMPTS with long outputs has to preempt.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=40)

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def pair(model: str, **kwargs) -> tuple[LLM, LLM]:
    """The same engine at tensor_parallel_size 1 and 2."""
    return LLM(model, **ENGINE, **kwargs), LLM(model, **ENGINE, tensor_parallel_size=2, **kwargs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[LLM, LLM]:
    folder = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path_factory.mktemp("llama"))
    return pair(str(folder))


@pytest.mark.parametrize("shape, overrides", [
    ("qwen2_qkv_bias", {}),
    ("mistral_linear_rope_window", {}),
    ("llama_gqa_untied", dict(num_key_value_heads=1)),  # one KV head, replicated on both ranks
    ("llama_mha_tied_bias", {}),  # o_proj and down_proj biases, added once after the all-reduce
    ("qwen3_moe", {}),  # every expert's columns split, one dense layer among the sparse ones
    ("mixtral_moe", {}),
    ("qwen2_moe", {}),  # the shared expert's columns split too, its gate whole on both ranks
    ("gpt_oss", {}),  # each rank its heads' sinks, its columns of every expert (and their biases)
])
def test_greedy_tokens_equal_size_one(tmp_path, shape, overrides):
    folder = save_checkpoint(make_hf_model(shape, **overrides), tmp_path)
    whole, split = pair(str(folder))
    assert greedy_tokens(split) == greedy_tokens(whole)


def test_llama_equal_with_preemption(llama):
    whole, split = llama
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert greedy_tokens(split, params=params) == greedy_tokens(whole, params=params)
    assert split.memory_stats()["num_preemptions"] > 0


def test_prefix_cache_hits_and_copy_on_write_forks(llama):
    whole, split = llama
    prompt = "a prefix read from the cache "
    for llm in (whole, split):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = split.generate([prompt + "and more"], GREEDY, use_tqdm=False)
    assert hits[0].num_cached_tokens > 0
    assert greedy_tokens(split, [prompt + "and more"]) == greedy_tokens(whole, [prompt + "and more"])
    # n > 1 forks share the prompt's blocks; the last, partly filled, is copied before writing.
    forks = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    outputs = [[list(c.token_ids) for c in llm.generate(["fork me"], forks, use_tqdm=False)[0].outputs]
               for llm in (whole, split)]
    assert outputs[0] == outputs[1]


def test_prompt_logprobs_come_from_every_rank(llama):
    whole, split = llama
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=2)
    got, want = (llm.generate(["some prompt to score"], params, use_tqdm=False)[0] for llm in (split, whole))
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_pooling_vectors_and_scores_equal_size_one(tmp_path):
    """A pooling engine's embeddings (the full hidden state on rank 0) and reranker scores (label
    logits from every rank's share of the LM head); its tuple settings reach the workers."""
    folder = save_checkpoint(make_hf_model("qwen3_qk_norm", max_position_embeddings=512), tmp_path)
    options = dict(ENGINE, runner="pooling", score_tokens=("n", "y"), num_kv_blocks=256)
    whole, split = LLM(str(folder), **options), LLM(str(folder), tensor_parallel_size=2, **options)
    for llm_call in (lambda llm: [o.outputs.data for o in llm.embed(PROMPTS, use_tqdm=False)],
                     lambda llm: [[o.outputs.score] for o in llm.score("fox?", PROMPTS[:2], use_tqdm=False)]):
        torch.testing.assert_close(torch.tensor(llm_call(split)), torch.tensor(llm_call(whole)),
                                   rtol=0, atol=1e-5)


def test_abort_under_tensor_parallelism(llama):
    whole, split = llama
    engine: LLMEngine = split.engine
    engine.add_request("kept", "keep going", GREEDY)
    engine.add_request("dropped", "stop me", SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("dropped")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["kept"]
    assert list(outputs[0].outputs[0].token_ids) == greedy_tokens(whole, ["keep going"])[0]
    assert engine.stats().kv.num_used_blocks == 0


def test_quantized_gguf_weights_split_on_their_groups(tmp_path):
    path, types = quantized_gguf(tmp_path, [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K],
                                 hidden_size=256, intermediate_size=512)
    whole, split = pair(str(path))
    assert "Q4_K quantized" in split.engine.weights_note
    assert greedy_tokens(split) == greedy_tokens(whole)


def test_quantized_weight_that_cannot_split_is_refused(tmp_path):
    # 6 heads of 16 dimensions, split 3 + 3: o_proj's inputs split at 48, inside a Q8_0 group of
    # 32. Dequantized at load, the same file splits.
    path, _ = quantized_gguf(tmp_path, [Q.Q8_0], hidden_size=96, num_attention_heads=6,
                             num_key_value_heads=6)
    with pytest.raises(ValueError, match=r"o_proj.weight \(Q8_0, 96 inputs\) cannot be split at "
                                         r"input 48: .*quantization='none'"):
        LLM(str(path), **ENGINE, tensor_parallel_size=2)
    whole, split = pair(str(path), quantization="none")
    assert greedy_tokens(split) == greedy_tokens(whole)


def test_sizes_that_do_not_split_are_refused_before_anything_starts(tmp_path, monkeypatch):
    folder = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path)  # 4 heads, 2 KV heads
    started = []

    def start(cls, *args):
        started.append(args)
        raise AssertionError("tensor-parallel workers were started")

    monkeypatch.setattr(TensorParallelDriver, "start", classmethod(start))
    with pytest.raises(ValueError, match="tensor_parallel_size=3: the model's 2 KV heads"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=8: each of the model's 2 KV heads "
                                         "would be replicated on 4 ranks, but has only 2"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=8)
    mla = save_checkpoint(make_hf_model("deepseek_v2_mla"), tmp_path / "mla")
    with pytest.raises(ValueError, match="tensor_parallel_size=2: latent attention .* not split"):
        LLM(str(mla), **ENGINE, tensor_parallel_size=2)
    assert started == []  # no worker was spawned
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=0)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_worker_that_dies_or_hangs_is_a_clear_error(tmp_path, fault):
    folder = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path)
    llm = LLM(str(folder), **ENGINE, tensor_parallel_size=2, distributed_timeout_s=3)
    assert greedy_tokens(llm, ["warm"])
    driver = llm.engine.engine_core.executor.driver
    (worker,) = driver._processes
    os.kill(worker.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    try:
        with pytest.raises(StepError) as info:
            greedy_tokens(llm, ["after the fault"])
        cause = info.value.__cause__
        assert isinstance(cause, TensorParallelError)
        if fault == "killed":
            assert "worker 1" in str(cause) and "exited with code -9" in str(cause)
        else:
            assert "Timed out" in str(cause)  # after distributed_timeout_s, not never
        # The group stays broken: the next step fails at once, with the same reason.
        with pytest.raises(StepError, match="tensor parallel"):
            greedy_tokens(llm, ["again"])
        assert llm.engine.stats().kv.num_used_blocks == 0
    finally:
        if fault == "hung":
            os.kill(worker.pid, signal.SIGCONT)
    driver.close()
    assert worker.poll() is not None


def test_workers_stop_with_the_engine(tmp_path):
    folder = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path)
    llm = LLM(str(folder), **ENGINE, tensor_parallel_size=2)
    (worker,) = llm.engine.engine_core.executor.driver._processes
    del llm
    gc.collect()
    assert worker.wait(timeout=10) == 0  # told to stop, it stopped cleanly


@requires_default_model
@pytest.mark.timeout(300)  # two engines on the default model: ~60 s under load
def test_default_model_greedy_tokens_equal_size_one():
    # SmolLM2-135M: 9 attention heads in 3 KV groups, split 6 + 3 heads (2 + 1 KV heads).
    whole = LLM(dtype="float32", num_kv_blocks=64)
    split = LLM(dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    assert "6/3 attention heads, 2/1 KV heads" in split.engine.weights_note
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert greedy_tokens(split, prompts) == greedy_tokens(whole, prompts)
