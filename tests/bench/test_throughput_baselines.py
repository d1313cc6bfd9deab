"""`bench throughput --baseline llama.cpp`: the worker protocol and the bench's scenarios, run
against a stand-in llama_cpp module (the real one lives in its own venv, never a dependency)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from pagedllm.bench import baselines
from pagedllm.bench.common import forget_cached_prefixes
from pagedllm.cli import main
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.model.tiny import make_hf_model, save_checkpoint, write_gguf

FAKE_LLAMA_CPP = textwrap.dedent('''
    import ctypes
    from types import SimpleNamespace

    __version__ = "fake"
    N_VOCAB = 256

    # The C API the batched scenario uses: each row asking for logits gets one-hot logits on
    # (its token + 1) % 256, the rule the Python API's generate() follows below.
    def llama_context_default_params():
        return SimpleNamespace()

    def llama_init_from_model(model, params):
        assert model == "fake model" and params.n_seq_max >= 1 and not params.kv_unified
        assert params.n_ctx % params.n_seq_max == 0  # each sequence's own cells
        return {"rows": {}, "positions": {}}

    def llama_batch_init(n_tokens, embd, n_seq_max):
        return SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens,
                               seq_id=[[0] for _ in range(n_tokens)], n_seq_id=[0] * n_tokens,
                               logits=[False] * n_tokens)

    def llama_decode(ctx, batch):
        ctx["rows"].clear()
        for row in range(batch.n_tokens):
            seq, pos = batch.seq_id[row][0], batch.pos[row]
            assert pos == ctx["positions"].get(seq, 0), "positions of a sequence come in order"
            ctx["positions"][seq] = pos + 1
            if batch.logits[row]:
                logits = (ctypes.c_float * N_VOCAB)()
                logits[(batch.token[row] + 1) % N_VOCAB] = 1.0
                ctx["rows"][row] = logits
        return 0

    def llama_get_logits_ith(ctx, row):
        return ctypes.cast(ctx["rows"][row], ctypes.POINTER(ctypes.c_float))

    def llama_batch_free(batch):
        pass

    def llama_free(ctx):
        pass

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose, draft_model):
            assert model_path.endswith(".gguf") and n_ctx > 0 and n_threads >= 1
            # --llama-cpp-prompt-lookup K reaches llama-cpp-python as its prompt-lookup draft
            assert draft_model is None or draft_model.num_pred_tokens == 4, draft_model
            self.prefills = 0
            self._model = SimpleNamespace(model="fake model")

        def n_vocab(self):
            return N_VOCAB

        def reset(self):
            pass

        def generate(self, tokens, top_k, top_p, min_p, temp, repeat_penalty):
            assert top_k == 1 and temp == 0.0  # greedy
            self.prefills += 1
            token = tokens[-1]
            while True:  # never stops by itself: the worker stops at max_tokens
                token = (token + 1) % N_VOCAB
                yield token
''')


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    package = tmp_path / "fake_site"
    (package / "llama_cpp").mkdir(parents=True)
    (package / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (package / "llama_cpp" / "llama_speculative.py").write_text(textwrap.dedent('''
        class LlamaPromptLookupDecoding:
            def __init__(self, num_pred_tokens):
                self.num_pred_tokens = num_pred_tokens
    '''))
    monkeypatch.setenv("PYTHONPATH", str(package))
    return sys.executable


@pytest.fixture(scope="module")
def tiny_model():
    return make_hf_model("llama_gqa_untied")


@pytest.fixture
def tiny_gguf(tiny_model, tmp_path):
    return write_gguf(tiny_model, tmp_path / "tiny.gguf")


def run_bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    code = main(["bench", "throughput", "--num-prompts", "3", "--input-len", "4-8", "--output-len", "2-5",
                 "--dtype", "float32", "--kv-cache-memory", "4MiB", "--threads", "1",
                 "--output-json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_llama_cpp_baseline_runs_the_same_requests(tmp_path, tiny_gguf, fake_llama_cpp, capsys):
    result = run_bench(tmp_path, "--model", str(tiny_gguf), "--baseline", "llama.cpp",
                       "--llama-cpp-python", fake_llama_cpp, "--single-stream-runs", "2",
                       "--single-stream-len", "6:4")
    ours, theirs = result["pagedllm"], result["llama.cpp"]
    assert theirs["version"] == "fake" and theirs["threads"] == 1 and theirs["peak_rss_mib"] > 0
    for system in (ours, theirs):
        assert system["single_stream"]["runs"] == 2
        assert len(system["single_stream"]["decode_tokens_per_s_each"]) == 2
        assert len(system["single_stream"]["decode_cpu_ms_per_token_each"]) == 2
        assert system["single_stream"]["decode_cpu_ms_per_token_median"] >= 0
        assert system["sequential"]["output_tokens_per_s"] > 0
    assert ours["output_tokens_per_s"] > 0 and ours["quantization"] == "auto"
    assert theirs["output_tokens_per_s"] > 0 and theirs["output_tokens_per_cpu_s"] > 0  # batched
    assert result["same_output"]["requests_identical"] == 0  # the stand-in's tokens are its own
    mine, rivals = (s["single_stream"]["decode_tokens_per_s_each"] for s in (ours, theirs))
    assert result["ratio_single_stream_each_run"] == [round(a / b, 2) for a, b in zip(mine, rivals)]
    medians = [s["single_stream"]["decode_tokens_per_s_median"] for s in (ours, theirs)]
    assert result["ratio_single_stream_decode_median"] == round(medians[0] / medians[1], 3)
    printed = capsys.readouterr().out
    assert "Single stream" in printed and "one request at a time" in printed
    assert "single-stream decode tok/s (medians)" in printed


def test_llama_cpp_batched_serves_every_request_at_once_in_continuous_batches(tmp_path, tiny_gguf,
                                                                              fake_llama_cpp):
    """More prompt tokens than one llama_decode call takes: prompts are fed in chunks beside the
    running sequences' next tokens, each sequence's positions in order (the stand-in checks),
    and each request gets exactly its max_tokens, the first from its prompt's last logits."""
    from pagedllm.bench.llama_cpp_baseline import Session
    from pagedllm.bench.llama_cpp_worker import N_BATCH
    from pagedllm.bench.workload import BenchRequest

    requests = [BenchRequest(list(range(1, 300)), 5), BenchRequest([7] * 400, 3), BenchRequest([250], 9)]
    assert sum(len(r.prompt_token_ids) for r in requests) > N_BATCH
    session = Session(fake_llama_cpp, tiny_gguf, threads=1, n_ctx=1024)
    try:
        assert session.batched(requests) > 0 and session.cpu_s >= 0
    finally:
        session.close()
    expected = [[(r.prompt_token_ids[-1] + 1 + j) % 256 for j in range(r.max_tokens)] for r in requests]
    assert session.token_ids == expected


def test_llama_cpp_speculates_by_prompt_lookup_when_asked(tmp_path, tiny_gguf, fake_llama_cpp, capsys):
    result = run_bench(tmp_path, "--model", str(tiny_gguf), "--baseline", "llama.cpp", "--no-sequential",
                       "--llama-cpp-python", fake_llama_cpp, "--single-stream-runs", "1",
                       "--single-stream-len", "6:4", "--llama-cpp-prompt-lookup", "4")
    assert result["llama.cpp"]["prompt_lookup"] == 4
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--num-prompts", "1", "--input-len", "4",
                 "--output-len", "2", "--kv-cache-memory", "4MiB", "--baseline", "llama.cpp",
                 "--llama-cpp-python", fake_llama_cpp, "--llama-cpp-prompt-lookup", "0"]) == 2
    assert "--llama-cpp-prompt-lookup" in capsys.readouterr().err


def test_llama_cpp_baseline_needs_its_interpreter_and_a_gguf(tmp_path, tiny_model, tiny_gguf, capsys):
    common = ["--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--kv-cache-memory", "4MiB"]
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--baseline", "llama.cpp", *common]) == 2
    assert "--llama-cpp-python" in capsys.readouterr().err
    folder = save_checkpoint(tiny_model, tmp_path / "folder")
    assert main(["bench", "throughput", "--model", str(folder), "--baseline", "llama.cpp",
                 "--llama-cpp-python", sys.executable, *common]) == 2
    assert "runs GGUF files" in capsys.readouterr().err


def test_every_baseline_declares_its_shape():
    for name in baselines.BASELINES:
        module = baselines.load(name)
        assert module.SYSTEM and set(module.SCENARIOS) <= {"batched", "sequential", "single_stream"}
        assert callable(module.add_args) and callable(module.start)


def test_lockstep_twin_engine(tmp_path, tiny_gguf, capsys):
    result = run_bench(tmp_path, "--model", str(tiny_gguf), "--lockstep-with", "block_size=8")
    lockstep = result["lockstep"]
    assert set(lockstep) == {"this", "block_size=8", "ratio_output_tokens_per_s",
                             "ratio_output_tokens_per_cpu_s"}
    assert lockstep["this"]["output_tokens_per_s"] > 0 and lockstep["ratio_output_tokens_per_s"] > 0
    assert lockstep["this"]["cpu_s"] > 0 and lockstep["ratio_output_tokens_per_cpu_s"] > 0
    assert "twin engine" in capsys.readouterr().out
    result = run_bench(tmp_path, "--model", str(tiny_gguf), "--lockstep-with", "block_size=8",
                       "--lockstep-single-stream", "--single-stream-runs", "2", "--single-stream-len", "6:4")
    single = result["lockstep"]["single_stream"]
    assert single["this"]["runs"] == single["block_size=8"]["runs"] == 2
    assert single["ratio_decode_tokens_per_s_median"] > 0
    assert "Single stream on both engines" in capsys.readouterr().out
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--num-prompts", "1", "--input-len", "4",
                 "--output-len", "2", "--kv-cache-memory", "4MiB", "--lockstep-with", "colour=red"]) == 2
    assert "FIELD=VALUE" in capsys.readouterr().err
    # The tier is one per process: building a twin at another would switch this engine's kernels.
    assert main(["bench", "throughput", "--model", str(tiny_gguf),
                 "--lockstep-with", "cpu_isa=portable"]) == 2
    assert "cannot change cpu_isa" in capsys.readouterr().err


def test_a_timed_rerun_finds_no_cached_prefix(tiny_gguf):
    """The lockstep and the baselines' scenarios rerun requests the engine served: with their
    prompts still cached, the engine would skip the prefill its rival or twin does."""
    engine = LLMEngine(model=str(tiny_gguf), dtype="float32", kv_cache_memory="4MiB", block_size=16)
    prompt = {"prompt_token_ids": list(range(1, 40))}  # two full blocks to cache

    def cached_tokens(request_id: str) -> int:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            outputs = engine.step()
        return outputs[-1].num_cached_tokens

    assert cached_tokens("first") == 0
    assert cached_tokens("again") > 0  # what a rerun would find
    forget_cached_prefixes(engine)
    assert cached_tokens("after") == 0


FAKE_VLLM = textwrap.dedent('''
    import os
    import time
    __version__ = "fake"
    print("vLLM logs to stdout; the worker must keep this off its replies")

    class SamplingParams:
        def __init__(self, temperature, max_tokens, min_tokens, ignore_eos):
            assert temperature == 0.0 and min_tokens == max_tokens and ignore_eos  # greedy, exact length
            self.max_tokens = max_tokens

    class _Completion:
        def __init__(self, token_ids):
            self.token_ids = token_ids

    class _Output:
        def __init__(self, token_ids):
            self.outputs = [_Completion(token_ids)]

    class LLM:
        def __init__(self, model, dtype, max_model_len, seed):
            assert os.path.isdir(model) and dtype in ("float32", "bfloat16") and max_model_len > 0
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] and int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) >= 1
            self.resets = 0

        def reset_prefix_cache(self):
            self.resets += 1

        def generate(self, prompts, params, use_tqdm):
            assert len(prompts) == len(params) and not use_tqdm
            time.sleep(0.2)  # a rate of the order of the engine's, so the ratio shows in 2 decimals
            busy_until = time.process_time() + 0.05  # and some CPU time for the worker to count
            while time.process_time() < busy_until:
                pass
            return [_Output([(p["prompt_token_ids"][-1] + i + 1) % 256 for i in range(s.max_tokens)])
                    for p, s in zip(prompts, params)]
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    package = tmp_path / "fake_vllm_site"
    (package / "vllm").mkdir(parents=True)
    (package / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(package))
    return sys.executable


def test_vllm_baseline_runs_the_workload_in_turn(tmp_path, tiny_model, fake_vllm, capsys):
    folder = save_checkpoint(tiny_model, tmp_path / "folder")
    result = run_bench(tmp_path, "--model", str(folder), "--baseline", "vllm", "--vllm-python", fake_vllm,
                       "--repeats", "2")
    ours, theirs = result["pagedllm"], result["vllm"]
    assert theirs["version"] == "fake" and theirs["dtype"] == "float32" and theirs["peak_rss_mib"] > 0
    assert theirs["threads_bind"] == "0" or theirs["threads_bind"].isdigit()  # one core: --threads 1
    for system in (ours, theirs):
        assert len(system["output_tokens_per_s_each"]) == 2
        assert system["output_tokens_per_s"] in system["output_tokens_per_s_each"]
    assert len(result["ratio_each_run"]) == 2 and result["ratio_output_tokens_per_s"] > 0
    for system in (ours, theirs):  # CPU seconds beside wall time: ours in process, vLLM's over its processes
        assert system["cpu_s"] > 0 and len(system["output_tokens_per_cpu_s_each"]) == 2
    assert theirs["cpu_s"] >= 0.04
    assert len(result["ratio_per_cpu_s_each_run"]) == 2 and result["ratio_output_tokens_per_cpu_s"] > 0
    assert 0 <= result["same_output"]["requests_identical"] <= 1
    printed = capsys.readouterr().out
    assert "pagedllm / vllm generated tokens/s" in printed and "each pair of runs" in printed
    assert "per CPU second" in printed


def test_vllm_baseline_needs_its_interpreter_and_a_folder(tmp_path, tiny_gguf, capsys):
    common = ["--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--kv-cache-memory", "4MiB"]
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--baseline", "vllm", *common]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--baseline", "vllm",
                 "--vllm-python", sys.executable, *common]) == 2
    assert "Hugging Face folders" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(tiny_gguf), "--repeats", "0", *common]) == 2
    assert "--repeats" in capsys.readouterr().err
