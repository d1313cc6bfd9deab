"""GGUF quantization types loaded by dequantizing: tensors written with gguf's writer, read back
through our reader, equal gguf's own dequantizer; where gguf can quantize a type, the values read
back are within the format's error of those quantized, and a whole model with such tensors gives
transformers' logits on the dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model.gguf_file import SUPPORTED_TYPES, GGUFCheckpoint
from pagedllm.model.loader import load_model
from tests.model.paged import PagedSequences
from tests.model.tiny import make_hf_model, write_gguf

Q = gguf.GGMLQuantizationType
NEW_TYPES = [Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL]
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # gguf.quants.quantize has these
# Byte offsets of each block's fp16 fields (scales, minimums), from gguf.quants' block layouts:
# random bytes there could be inf or NaN.
FP16_FIELDS = {Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0]}
SHAPE = (6, 512)  # rows x columns: two 256-element K-quant blocks per row


def random_blocks(qtype, shape, rng: np.random.Generator) -> np.ndarray:
    """Random quantized bytes [rows, bytes per row] with small finite fp16 scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = shape[0] * shape[1] // block_elems
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=(num_blocks, 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_tensors(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFCheckpoint(path)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_types_read_as_gguf_dequantizes_them(qtype, tmp_path):
    assert qtype in SUPPORTED_TYPES
    raw = random_blocks(qtype, SHAPE, np.random.default_rng(qtype.value))
    checkpoint = write_tensors(tmp_path / "q.gguf", {"blk.0.ffn_down.weight": (raw, qtype)})
    checkpoint.check_types()  # accepted
    ours = checkpoint.get_raw("blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == SHAPE
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert torch.equal(ours, torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_round_trip_within_the_format_error(qtype, tmp_path):
    values = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    quantized = gguf.quants.quantize(values, qtype)
    checkpoint = write_tensors(tmp_path / "q.gguf", {"output.weight": (quantized, qtype)})
    ours = checkpoint.get_raw("output.weight").numpy()
    # Each 32-value block keeps its values to within one quantization step of its range.
    blocks = values.reshape(-1, 32)
    step = (blocks.max(1) - blocks.min(1)) / {Q.Q4_0: 15, Q.Q4_1: 15, Q.Q5_0: 31, Q.Q5_1: 31,
                                               Q.Q8_0: 127}[qtype]
    error = np.abs(ours.reshape(-1, 32) - blocks).max(1)
    assert (error <= step + 1e-6).all()


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_model_with_narrow_tensors_in_a_new_type(qtype, tmp_path):
    """As llama.cpp's Q4_K_M files hold some ffn_down tensors as Q5_0: the model built from them
    gives the logits of transformers holding the same dequantized weights."""
    hf_model = make_hf_model("llama_gqa_untied", seed=21)
    names = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight"}
    path = write_gguf(hf_model, tmp_path / "mixed.gguf", quantize=dict.fromkeys(names, qtype))
    with torch.no_grad():
        state = hf_model.state_dict()
        for hf_name in names.values():
            weight = state[hf_name].numpy()
            state[hf_name].copy_(torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)))
    model = load_model(path, dtype="float32").model
    ids = list(range(40, 60))
    ours = PagedSequences(model, num_blocks=8, block_size=4).step({0: ids})[0]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - expected).abs().max() <= 1e-4
