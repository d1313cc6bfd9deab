"""Random but well-formed GGUF blocks of every repackable type, for tests.

Random bytes are valid codes for every block type; only the scale fields need care (a random
fp16 may be NaN, inf or huge, a random E8M0 exponent up to 2^127), so they are overwritten with
small finite values (fp16: of both signs).
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Byte offsets of each type's fp16 fields (d, and dmin / m where the type has one).
FP16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.IQ4_NL: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.MXFP4: (),
}
# Byte offsets of each type's E8M0 fields (a power of two's exponent, biased by 127).
E8M0_FIELDS = {Q.MXFP4: (0,)}


# A scale for each type's fp16 fields that gives weights of about +-0.1 (the largest code value
# times the largest sub-block scale of each type, over 0.1).
TYPICAL_SCALE = {
    Q.Q4_0: 0.1 / 8, Q.Q4_1: 0.1 / 15, Q.Q5_0: 0.1 / 16, Q.Q5_1: 0.1 / 31, Q.Q8_0: 0.1 / 127,
    Q.IQ4_NL: 0.1 / 127, Q.Q2_K: 0.1 / 45, Q.Q3_K: 0.1 / 128, Q.Q4_K: 0.1 / 945,
    Q.Q5_K: 0.1 / 1953, Q.Q6_K: 0.1 / 4064, Q.MXFP4: 0.1 / 6,
}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0, scale: float | None = None) -> np.ndarray:
    """uint8 [rows, bytes per row] holding rows x cols weights of qtype."""
    scale = TYPICAL_SCALE[qtype] if scale is None else scale
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = (rng.uniform(0.2, 1.0, len(blocks)) * rng.choice([-1, 1], len(blocks)) * scale)
        blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for offset in E8M0_FIELDS.get(qtype, ()):
        blocks[:, offset] = np.round(np.log2(scale)) + 127 - rng.integers(0, 3, len(blocks))
    return blocks.reshape(rows, -1)


def write_tensors(path, tensors: dict[str, tuple[Q, np.ndarray]]) -> None:
    """A GGUF file holding only the given raw tensors (name -> (type, uint8 blocks))."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_blocks(weights: np.ndarray, qtype: Q) -> np.ndarray:
    """weights [rows, cols] in qtype: quantized by gguf where it has a quantizer for the type,
    else random blocks of the type (the K-quants; a test then compares paths on the same file).
    Stacked experts [E, rows, cols] are quantized as E * rows rows, and keep their leading shape."""
    if weights.ndim == 3:
        experts, rows, cols = weights.shape
        flat = quantized_blocks(weights.reshape(experts * rows, cols), qtype)
        return flat.reshape(experts, rows, -1)
    try:
        return gguf.quants.quantize(weights.astype(np.float32), qtype)
    except NotImplementedError:
        rows, cols = weights.shape
        return random_blocks(qtype, rows, cols, seed=rows * cols)
