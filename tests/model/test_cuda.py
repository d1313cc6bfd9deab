"""The model and the engine on CUDA, against transformers on the same GPU with TF32 off: tiny
random models' logits through the paged cache (prefill, then a chunk after cached context) and
their greedy tokens through the whole engine (CUDA graphs and eager), the default model's fp32
greedy tokens (its GGUF kept quantized), and the engine's device state. `make gpu-check` runs these; a
machine without CUDA skips them (the CPU-side checks of the same path are tests/test_device.py and
the Triton kernel under the interpreter, tests/kernels/test_triton_attention.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from pagedllm.kernels import attention
from pagedllm.model.loader import load_model
from pagedllm.sampling_params import SamplingParams
from tests.conftest import requires_default_model
from tests.model.paged import PagedSequences
from tests.model.tiny import SHAPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: `make gpu-check` runs these where there is one")

TOLERANCE = 1e-4  # fp32, as the CPU equivalence tests


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    """IEEE float32 matmuls in transformers and in ours (the Triton kernel never uses TF32)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def token_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(258) for _ in range(length)]


@torch.inference_mode()
def hf_chunked_logits(hf_model, ids: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    past, logits, start = None, [], 0
    for size in chunk_sizes:
        out = hf_model(torch.tensor([ids[start:start + size]], device="cuda"), past_key_values=past,
                       use_cache=True)
        past, start = out.past_key_values, start + size
        logits.append(out.logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tiny_model_logits_match_transformers(shape, tiny_checkpoint, monkeypatch):
    checkpoint = tiny_checkpoint(shape)
    model = load_model(checkpoint.folder, dtype="float32", device="cuda").model
    hf_model = copy.deepcopy(checkpoint.hf_model).to("cuda")
    calls = []
    kernel = attention._triton_attention()
    assert kernel is not None, "Triton is not importable on this CUDA machine"
    run = kernel.paged_attention
    monkeypatch.setattr(kernel, "paged_attention", lambda *a, **k: calls.append(1) or run(*a, **k))

    ids = token_ids(40, seed=3)
    paged = PagedSequences(model, num_blocks=16, block_size=4)
    # A prompt alone, then a chunk after its cached context batched with another's prefill.
    first = paged.step({0: ids[:23]})[0]
    batch = paged.step({0: ids[23:], 1: ids[:9]})
    ours = torch.cat([first, batch[0]])
    expected = hf_chunked_logits(hf_model, ids, [23, 17])
    worst = (ours - expected).abs().max().item()
    assert worst <= TOLERANCE, f"max abs logit difference {worst:.2e} > {TOLERANCE}"
    torch.testing.assert_close(batch[1], hf_chunked_logits(hf_model, ids[:9], [9]), atol=TOLERANCE, rtol=0)
    if checkpoint.hf_model.config.model_type == "gpt_oss":  # sinks: the torch path, on every device
        assert not calls, "attention with sinks ran the Triton kernel, which has none"
    else:
        assert calls, "CUDA attention did not run the Triton kernel"


# Not dynamic NTK rope: past the model's length (16) its frequencies depend on the sequence length
# at the time a key is computed, which for a prompt cut into chunks is each chunk's end here and
# the whole prompt's in transformers' generate; the logits test above covers that shape.
GREEDY_SHAPES = sorted(set(SHAPES) - {"llama_dynamic_rope"})


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("shape", GREEDY_SHAPES)
def test_tiny_model_greedy_tokens_equal_transformers(shape, enforce_eager, tiny_checkpoint):
    """The whole engine on the GPU (blocks of 4, prefills cut into chunks beside other requests'
    decodes; decode steps replayed from CUDA graphs, or eagerly) generates transformers' greedy
    tokens on the same GPU, in float32."""
    from pagedllm.entrypoints.llm import LLM
    from tests.model.test_llama_equivalence import ENGINE_PROMPTS

    checkpoint = tiny_checkpoint(shape)
    llm = LLM(model=str(checkpoint.folder), dtype="float32", device="cuda", block_size=4, max_model_len=64,
              kv_cache_memory="1MiB", max_num_batched_tokens=24, max_num_seqs=4,
              enforce_eager=enforce_eager)
    sinks = checkpoint.hf_model.config.model_type == "gpt_oss"  # the torch attention: never captured
    assert (llm.engine.engine_core.executor.runner.decode_graphs is None) == (enforce_eager or sinks)
    prompts = [token_ids(length, seed=20 + length) for length in ENGINE_PROMPTS.get(shape, (13, 3, 20))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_model = copy.deepcopy(checkpoint.hf_model).to("cuda")
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            expected = hf_model.generate(ids, eos_token_id=[], pad_token_id=0, max_new_tokens=12,
                                         do_sample=False, attention_mask=torch.ones_like(ids))
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def cuda_llm(default_model_path):
    from pagedllm.entrypoints.llm import LLM

    return LLM(model=str(default_model_path), dtype="float32", device="cuda", kv_cache_memory="1GiB",
               max_model_len=1024)


@requires_default_model
def test_default_model_fp32_greedy_equals_transformers(cuda_llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in cuda_llm.generate(PROMPTS, params, use_tqdm=False)]
    hf_model = copy.deepcopy(hf_default_model).to("cuda")
    tokenizer = cuda_llm.get_tokenizer()
    for prompt, our_ids in zip(PROMPTS, ours):
        ids = torch.tensor([tokenizer.encode(prompt)], device="cuda")
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                    min_new_tokens=32, do_sample=False, pad_token_id=0)
        assert our_ids == out[0, ids.shape[1]:].tolist(), prompt


@requires_default_model
def test_engine_state_lives_on_the_gpu(cuda_llm):
    core = cuda_llm.engine.engine_core
    assert core.device.type == "cuda"
    assert {p.device.type for p in core.executor.runner.model.parameters()} == {"cuda"}
    assert {t.device.type for pair in core.executor.runner.kv_caches for t in pair} == {"cuda"}
    assert core.sampler.generator.device.type == "cuda"


@requires_default_model
def test_seeded_sampling_n_and_prefix_sharing_on_the_gpu(cuda_llm):
    """Per-request CUDA generators reproduce; n > 1 forks share prompt blocks (copy-on-write on
    the GPU) and greedy children agree."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, n=3)
    first = cuda_llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0]
    again = cuda_llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    greedy = cuda_llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, n=2),
                               use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


@requires_default_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_agree_with_fp32_on_an_easy_prompt(dtype, cuda_llm, default_model_path):
    """The same first token (" Paris") as fp32: the 16-bit paths (Triton's tensor-core matmuls
    included) run and stay sane; later tokens may part where fp32's top two are close."""
    from pagedllm.entrypoints.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = cuda_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model=str(default_model_path), dtype=dtype, device="cuda", kv_cache_memory="256MiB",
              max_model_len=512)
    got = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 8 and got[0] == expected[0]


@requires_default_model
def test_gguf_weights_stay_quantized_on_the_gpu(cuda_llm, default_model_path):
    """The default model's Q4_1 / Q8_0 matrices are kept as codes in GPU memory (the Triton
    matmul dequantizes inside the kernel), and its greedy tokens equal those of the same file
    dequantized at load."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.quant_linear import QuantLinear

    model = cuda_llm.engine.engine_core.executor.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized and {p.codes.device.type for m in quantized for p in m.parts} == {"cuda"}
    dequantized = LLM(model=str(default_model_path), dtype="float32", device="cuda",
                      kv_cache_memory="256MiB", max_model_len=512, quantization="none")
    assert dequantized.engine.weight_bytes > 2 * cuda_llm.engine.weight_bytes
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for ours, theirs in zip(cuda_llm.generate(PROMPTS, params, use_tqdm=False),
                            dequantized.generate(PROMPTS, params, use_tqdm=False)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
