"""Every way a user can point the loader at a bad model gives a clear error naming the problem."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.model.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    ModelFileNotFoundError,
    ModelLoadError,
    ShapeMismatchError,
    UnsupportedModelError,
)
from pagedllm.model.loader import load_model, resolve_dtype
from tests.model.tiny import make_hf_model, write_gguf


@pytest.fixture
def folder(tiny_checkpoint, tmp_path):
    """A private copy of a tiny checkpoint that a test may damage."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama_gqa_untied").folder, copy)
    return copy


@contextmanager
def expect(error: type[Exception], *fragments: str):
    """pytest.raises that also checks the message names the file and the problem."""
    with pytest.raises(error) as info:
        yield
    assert isinstance(info.value, ValueError)  # the server turns these into 400s
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_architecture(folder):
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with expect(UnsupportedModelError, "GPT2LMHeadModel", "LlamaForCausalLM"):
        load_model(folder, dtype="float32")


def test_unsupported_rope_type(folder):
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "mrope", "factor": 2.0, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(config))
    with expect(UnsupportedModelError, "mrope"):
        load_model(folder, dtype="float32")


def test_missing_path(tmp_path):
    with expect(ModelFileNotFoundError, "nowhere"):
        load_model(tmp_path / "nowhere", dtype="float32")
    assert issubclass(ModelFileNotFoundError, FileNotFoundError)


@pytest.mark.parametrize("name, fragment", [
    ("config.json", "config.json"),
    ("model.safetensors", "safetensors"),
    ("tokenizer.json", "tokenizer.json"),
])
def test_missing_file(folder, name, fragment):
    (folder / name).unlink()
    with expect(ModelFileNotFoundError, fragment, str(folder)):
        load_model(folder, dtype="float32")


def test_missing_shard(tmp_path, tiny_checkpoint):
    from tests.model.tiny import save_checkpoint

    folder = save_checkpoint(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path,
                             max_shard_size="40KB")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    with expect(ModelFileNotFoundError, shard.name):
        load_model(folder, dtype="float32")


def test_pickled_weights_are_refused(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with expect(UnsupportedModelError, "pickle"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_truncated_safetensors(folder, keep_fraction):
    weights = folder / "model.safetensors"
    os.truncate(weights, int(weights.stat().st_size * keep_fraction))
    with expect(CorruptCheckpointError, str(weights), "truncated"):
        load_model(folder, dtype="float32")


def test_missing_tensor(folder):
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with expect(MissingTensorError, "model.layers.1.self_attn.k_proj.weight", str(folder)):
        load_model(folder, dtype="float32")


@pytest.fixture
def tiny_gguf(tiny_checkpoint, tmp_path):
    return write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path / "tiny.gguf")


@pytest.mark.parametrize("keep_fraction", [0.02, 0.5, 0.999])
def test_truncated_gguf(tiny_gguf, keep_fraction):
    os.truncate(tiny_gguf, int(tiny_gguf.stat().st_size * keep_fraction))
    with expect(CorruptCheckpointError, str(tiny_gguf), "truncated"):
        load_model(tiny_gguf, dtype="float32")


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip")
    with expect(CorruptCheckpointError, "not a GGUF file"):
        load_model(fake, dtype="float32")


def test_unsupported_quantization(tiny_checkpoint, tmp_path):
    path = write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path / "nvfp4.gguf",
                      raw_types={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.NVFP4})
    with expect(UnsupportedModelError, "NVFP4", "blk.1.ffn_up.weight", str(path)):
        load_model(path, dtype="float32")


def test_qwen3_5_gguf_is_refused_naming_a_tensor(tmp_path):
    # Its Gated DeltaNet layers' ssm_* tensors are not mapped from GGUF: refused in one line naming
    # the architecture and the first tensor in the file we cannot read.
    path = write_gguf(make_hf_model("qwen3_5_hybrid"), tmp_path / "qwen35.gguf")
    with expect(UnsupportedModelError, str(path), "GGUF architecture 'qwen35'",
                "cannot map tensor blk.0.ssm_a ", "Hugging Face folder"):
        load_model(path, dtype="float32")


def test_a_gguf_tensor_nothing_reads_is_refused(tiny_checkpoint, tmp_path):
    # Attention sinks (gpt-oss's, mapped) in a Llama file, whose model has no place for them:
    # refused, not run without them.
    path = write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path / "extra.gguf",
                      extra={"blk.1.attn_sinks.weight": torch.ones(4)})
    with expect(UnsupportedModelError, "GGUF architecture 'llama'",
                "no place in the model for tensor blk.1.attn_sinks.weight (1 tensors unread)"):
        load_model(path, dtype="float32")


def test_other_file_types_are_refused(tmp_path):
    other = tmp_path / "weights.pt"
    other.write_bytes(b"\x80\x04")
    with expect(ModelLoadError, "weights.pt", ".gguf"):
        load_model(other, dtype="float32")


def test_resolve_dtype():
    assert resolve_dtype("fp32") is torch.float32 is resolve_dtype(torch.float32)
    assert resolve_dtype("bf16") is torch.bfloat16 is resolve_dtype("bfloat16")
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("auto") in (torch.float32, torch.bfloat16)
    for bad in ("int8", "float64", torch.int64):
        with pytest.raises(ValueError, match="dtype"):
            resolve_dtype(bad)


@pytest.mark.parametrize("int8_activations", [True, False])
def test_auto_is_bfloat16_where_quantized_weights_meet_int8_activations(
        tiny_checkpoint, tmp_path, monkeypatch, int8_activations):
    """On a CPU without bf16 math, "auto" is bf16 for a model whose matrices stay quantized where
    the kernels take int8 activations; float32 for float weights, quantization=none, or kernels
    without int8 activations. An explicit dtype is kept."""
    from pagedllm.kernels import tiers
    from pagedllm.model import loader

    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(tiers.KernelChoice, "int8_activations", property(lambda self: int8_activations))
    hf_model = tiny_checkpoint("llama_gqa_untied").hf_model
    quantized = write_gguf(hf_model, tmp_path / "q8.gguf",
                           quantize={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0})
    floats = write_gguf(hf_model, tmp_path / "f32.gguf")
    expected = torch.bfloat16 if int8_activations else torch.float32
    assert loader.resolve_model_dtype("auto", "cpu", quantized) is expected
    folder = tiny_checkpoint("llama_gqa_untied").folder
    assert loader.resolve_model_dtype("auto", "cpu", folder, "int8") is expected
    assert loader.resolve_model_dtype("auto", "cpu", floats) is torch.float32
    assert loader.resolve_model_dtype("auto", "cpu", quantized, "none") is torch.float32
    assert loader.resolve_model_dtype("auto", "cpu", tmp_path / "missing.gguf") is torch.float32
    assert loader.resolve_model_dtype("float32", "cpu", quantized) is torch.float32
    assert load_model(quantized).model.norm.weight.dtype is expected


def test_config_missing_a_required_key_names_it(tmp_path):
    from pagedllm.model.errors import ModelLoadError
    from pagedllm.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        load_model(tmp_path, dtype="float32")


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "576"), ("num_attention_heads", 0), ("vocab_size", 4e9),
    ("vocab_size", 4_000_000_000), ("num_key_value_heads", -2), ("num_hidden_layers", True),
    ("intermediate_size", "NoneType"), ("head_dim", 1.5),
    ("max_position_embeddings", [2048]), ("rms_norm_eps", "1e-5"), ("rope_theta", 0),
])
def test_a_damaged_config_field_is_one_line_naming_it(folder, field, value):
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with expect(ModelLoadError, "config.json", field, repr(value)):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("field, delta, tensor", [
    ("intermediate_size", 8, "mlp.gate_up_proj.weight"), ("head_dim", 16, "self_attn.qkv_proj.weight"),
    ("vocab_size", 10, "embed_tokens.weight"), ("vocab_size", -10, "embed_tokens.weight"),
    ("num_key_value_heads", 2, "self_attn.qkv_proj.weight"),
])
def test_a_config_that_disagrees_with_the_weights_is_one_line_naming_the_tensor(folder, field, delta, tensor):
    """Issue 32, finding 7: torch's many-line load_state_dict error became a traceback at start."""
    config = json.loads((folder / "config.json").read_text())
    config[field] += delta
    (folder / "config.json").write_text(json.dumps(config))
    with expect(ShapeMismatchError, tensor, "in the weights, the config makes it"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("dimensions", [3, 18, 100])
def test_a_rotary_dimension_the_heads_cannot_hold_is_one_line(tiny_checkpoint, tmp_path, dimensions):
    """Issue 32, finding 8: a GGUF whose rope.dimension_count is odd or past head_dim (16 here)
    loaded, then failed every request's step."""
    path = tmp_path / "damaged.gguf"
    write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, path)
    reader = gguf.GGUFReader(path)
    metadata = {name: f.contents() for name, f in reader.fields.items()}
    from pagedllm.model.config import ModelConfig

    metadata["llama.rope.dimension_count"] = dimensions
    with pytest.raises(ModelLoadError, match="must be an even number from 2 to head_dim") as info:
        ModelConfig.from_gguf_metadata(metadata, {t.name for t in reader.tensors})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field, value", [("attention.head_count", 0), ("embedding_length", -1),
                                          ("vocab_size", 2**40)])
def test_a_damaged_gguf_field_is_one_line_naming_it(tiny_checkpoint, tmp_path, field, value):
    path = tmp_path / "damaged.gguf"
    write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, path)
    reader = gguf.GGUFReader(path)
    metadata = {name: f.contents() for name, f in reader.fields.items()}
    from pagedllm.model.config import ModelConfig

    metadata[f"llama.{field}"] = value
    with pytest.raises(ModelLoadError, match=f"GGUF metadata: {field} must be a positive integer") as info:
        ModelConfig.from_gguf_metadata(metadata, {t.name for t in reader.tensors})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.3, 0.9])
def test_a_truncated_tokenizer_json_is_one_line(folder, keep_fraction):
    tokenizer = folder / "tokenizer.json"
    os.truncate(tokenizer, int(tokenizer.stat().st_size * keep_fraction))
    with expect(ValueError, str(tokenizer), "truncated or damaged"):
        load_model(folder, dtype="float32")


def test_the_cli_says_a_damaged_config_in_one_line(folder):
    import subprocess
    import sys

    config = json.loads((folder / "config.json").read_text())
    config["num_attention_heads"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "pagedllm.cli", "generate", "hi", "--model", str(folder)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pagedllm: error: config.json: num_attention_heads must be a positive integer (at most "
        "2147483647); got 0"]
