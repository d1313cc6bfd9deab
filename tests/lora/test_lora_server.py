"""LoRA over HTTP, the engine core in its own process: --lora-modules' adapters listed by
/v1/models with the base as parent, picked by a request's model name; /v1/load_lora_adapter and
/v1/unload_lora_adapter behind --allow-runtime-lora-updating; an adapter unloaded while its
requests run lets them finish with it; bad adapters refused in one line naming them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from pagedllm.config import EngineConfig
from tests.lora.adapters import greedy_reference, make_adapter
from tests.model.tiny import make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer

pytest.importorskip("peft")

PROMPT = [5, 17, 99, 3, 42, 8, 250, 11, 60, 7]


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """The base's folder, {name: (adapter folder, merged transformers model)}, the base model."""
    root = tmp_path_factory.mktemp("lora_server")
    base = save_checkpoint(make_hf_model("llama_gqa_untied", seed=7), root / "base")
    adapters = {}
    for i, (name, targets, rank) in enumerate((("sql", ["q_proj", "v_proj"], 4),
                                               ("poet", ["o_proj", "down_proj", "up_proj"], 8),
                                               ("big", ["q_proj"], 16))):
        folder, merged = make_adapter(make_hf_model("llama_gqa_untied", seed=7), root / name, targets,
                                      rank, False, seed=40 + i)
        adapters[name] = (folder, merged.eval())
    return base, adapters, make_hf_model("llama_gqa_untied", seed=7).eval()


def config(base, adapters, **kwargs) -> EngineConfig:
    return EngineConfig(**{"model": str(base), "dtype": "float32", "num_kv_blocks": 64, "block_size": 16,
                           "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                           "lora_modules": tuple(f"{n}={adapters[n][0]}" for n in ("sql", "poet")),
                           **kwargs})


def complete(server, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def text_of(server, hf_model, num_tokens: int = 8) -> str:
    tokenizer = server.async_engine.input_processor.tokenizer
    return tokenizer.decode(greedy_reference(hf_model, PROMPT, num_tokens))


def test_models_list_the_adapters_and_a_request_picks_one_by_name(tiny_lora):
    base, adapters, hf_base = tiny_lora
    with RunningServer(config(base, adapters)) as server:
        cards = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [
            (MODEL_NAME, None), ("sql", MODEL_NAME), ("poet", MODEL_NAME)]
        for model, reference in ((MODEL_NAME, hf_base), ("sql", adapters["sql"][1]),
                                 ("poet", adapters["poet"][1])):
            answer = complete(server, model)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == text_of(server, reference), model
            assert answer.json()["model"] == model  # the name asked for, as vLLM answers
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "poet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in chat.text.splitlines()
                  if line.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {"poet"}
        plain = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 2}).json()
        assert plain["model"] == MODEL_NAME  # model left out: the base's name
        unknown = complete(server, "nope")
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'nope' does not exist" in error["message"] and "'sql'" in error["message"]
        # Without --allow-runtime-lora-updating the runtime endpoints are not there.
        load = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=10,
                          json={"lora_name": "big", "lora_path": str(adapters["big"][0])})
        assert load.status_code == 404
        assert server.wait_idle().kv.num_used_blocks == 0


def bad_adapters(adapters, tmp_path) -> dict[str, str]:
    """name -> folder of adapters the base cannot serve, each for another reason."""
    from safetensors.torch import load_file, save_file

    sql = adapters["sql"][0]
    made = {}
    for name, rename in (("ghost", lambda k: k.replace("layers.1.", "layers.9.")),
                         ("headless", lambda k: k.replace("self_attn.q_proj", "self_attn.w_proj"))):
        folder = tmp_path / name
        shutil.copytree(sql, folder)
        tensors = load_file(sql / "adapter_model.safetensors")
        save_file({rename(k): v for k, v in tensors.items()}, folder / "adapter_model.safetensors")
        made[name] = folder
    made["corrupt"] = tmp_path / "corrupt"
    shutil.copytree(sql, made["corrupt"])
    (made["corrupt"] / "adapter_model.safetensors").write_bytes(b"\x07" * 100)
    other = make_hf_model("llama_gqa_untied", hidden_size=32, intermediate_size=48)
    made["stranger"] = make_adapter(other, tmp_path / "stranger", ["q_proj"], 4, False, seed=1)[0]
    made["big"] = adapters["big"][0]  # rank 16 over --max-lora-rank 8
    return {name: str(folder) for name, folder in made.items()}


def test_runtime_load_and_unload(tiny_lora, tmp_path):
    base, adapters, hf_base = tiny_lora
    with RunningServer(config(base, adapters, allow_runtime_lora_updating=True)) as server:
        url = server.base_url
        bad = bad_adapters(adapters, tmp_path)
        expected_words = {"ghost": "does not have", "headless": "no LoRA slot", "corrupt": "damaged",
                          "stranger": "another base model", "big": "exceeds --max-lora-rank 8"}
        assert set(bad) == set(expected_words)
        for name, words in expected_words.items():
            refused = httpx.post(f"{url}/v1/load_lora_adapter", timeout=30,
                                 json={"lora_name": name, "lora_path": bad[name]})
            assert refused.status_code == 400, (name, refused.text)
            message = refused.json()["error"]["message"]
            assert message.startswith(f"LoRA adapter {name!r}: ") and "\n" not in message, message
            assert words in message, (name, message)
            assert complete(server, name).status_code == 404  # not offered
        taken = httpx.post(f"{url}/v1/load_lora_adapter", timeout=10,
                           json={"lora_name": "sql", "lora_path": str(adapters["poet"][0])})
        assert taken.status_code == 400 and "taken" in taken.json()["error"]["message"]
        # "sql" again, from poet's folder: another adapter under the old name.
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", timeout=10, json={"lora_name": "sql"})
        assert unload.status_code == 200 and "removed" in unload.text
        assert complete(server, "sql").status_code == 404
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", timeout=10,
                            json={"lora_name": "sql", "lora_path": str(adapters["poet"][0])})
        assert loaded.status_code == 200 and "added" in loaded.text
        assert complete(server, "sql").json()["choices"][0]["text"] == text_of(server, adapters["poet"][1])
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", timeout=10, json={"lora_name": "never"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert server.wait_idle().kv.num_used_blocks == 0


def test_requests_in_flight_finish_with_an_unloaded_adapter(tiny_lora):
    base, adapters, _ = tiny_lora
    with RunningServer(config(base, adapters, allow_runtime_lora_updating=True)) as server:
        server.debug("slow_steps", seconds=0.05)  # 40 tokens take 2 s: the unload comes midway
        url = server.base_url
        body = {"model": "poet", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text, finish = "", None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    break
            unload = httpx.post(f"{url}/v1/unload_lora_adapter", timeout=10, json={"lora_name": "poet"})
            assert unload.status_code == 200
            assert complete(server, "poet").status_code == 404  # new requests: no such model
            assert server.async_engine.has_unfinished_requests()  # the unload came midway
            for line in lines:
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
        assert finish == "length"
        assert text == text_of(server, adapters["poet"][1], 40)
        assert server.wait_idle().kv.num_used_blocks == 0


def test_a_bad_lora_module_stops_the_start_in_one_line(tiny_lora):
    from pagedllm.engine.core_client import CoreProcess, CoreStartupError

    base, adapters, _ = tiny_lora
    bad = config(base, adapters, max_lora_rank=4)  # poet's rank is 8
    core = CoreProcess(bad, num_threads=1)
    try:
        with pytest.raises(CoreStartupError, match="^LoRA adapter 'poet': rank 8 exceeds --max-lora-rank 4$"):
            core.wait_ready()
    finally:
        core.close()
