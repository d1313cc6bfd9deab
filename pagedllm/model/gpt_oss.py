"""gpt-oss's stacked experts in a Hugging Face folder, read as one expert's tensors at a time.

transformers stores each layer's experts in four tensors: gate_up_proj [E, hidden, 2I] (inputs
first, the gate and up columns interleaved: gate is every even column, up every odd one),
gate_up_proj_bias [E, 2I] (interleaved alike), down_proj [E, I, hidden] and down_proj_bias
[E, hidden]. The model holds each expert as an ordinary MLP (model/moe.py), so the loader asks
for the per-expert names a GGUF file's stacked tensors also give (gguf_file.py), and this view
cuts them out: mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}, weights as [out, in]. Every other
tensor passes through under its own name.

The released checkpoints store the expert weights as MXFP4 instead: {gate_up,down}_proj_blocks
[E, out, in / 32, 16] (each byte two E2M1 codes, the even input in the low nibble) and _scales
[E, out, in / 32] (each block's E8M0 exponent, biased by 127), rows already [out, in]. An expert's
rows are rewritten as GGUF's MXFP4 blocks (the exponent byte, then the codes in Q4_0's nibble
order) and repacked by gguf_repack like a GGUF's: kept MXFP4 in memory, or dequantized to the same
float32 values where the loader's policy says so (UnstackedExperts' dequantize).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.model.gguf_repack import repack
from pagedllm.model.quant_weight import QuantizedWeight

_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)")


class UnstackedExperts:
    """names and get() of a checkpoint's tensors (SafetensorsWeights' interface), each stacked
    experts tensor (float, or MXFP4 blocks and scales) replaced by its num_experts experts' own.
    dequantize: MXFP4 experts come as float32 tensors, not QuantizedWeight."""

    def __init__(self, names: set[str], get: Callable[[str], torch.Tensor], num_experts: int,
                 dequantize: bool = False):
        self._get = get
        self._dequantize = dequantize
        self._mxfp4 = {m[1] + "." + m[2] for n in names if (m := _STACKED.fullmatch(n)) and m[3] == "_blocks"}
        # The stacked tensors of the layer read last: the loader asks for a layer's experts in turn.
        self._layer: tuple[str, dict[str, torch.Tensor]] = ("", {})
        self.names = set()
        for name in names:
            match = _STACKED.fullmatch(name)
            if match is None:
                self.names.add(name)
                continue
            if match[3] == "_scales":
                continue  # named by its _blocks
            prefix, kind = match[1], "bias" if match[3] == "_bias" else "weight"
            projections = ("gate", "up") if match[2] == "gate_up_proj" else ("down",)
            self.names.update(f"{prefix}.{e}.{p}_proj.{kind}"
                              for p in projections for e in range(num_experts))

    def get(self, name: str) -> torch.Tensor | QuantizedWeight:
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            return self._get(name)
        prefix, expert, projection, kind = match[1], int(match[2]), match[3], match[4]
        stacked = "gate_up_proj" if projection in ("gate", "up") else "down_proj"
        if kind == "weight" and f"{prefix}.{stacked}" in self._mxfp4:
            return self._mxfp4_rows(prefix, stacked, expert, projection)
        tensor = self._stacked(prefix, f"{stacked}{'_bias' if kind == 'bias' else ''}")[expert]
        if kind == "weight":
            tensor = tensor.t()  # stored [in, out]
        if projection != "down":
            tensor = tensor[0::2] if projection == "gate" else tensor[1::2]
        return tensor.contiguous()

    def _mxfp4_rows(self, prefix: str, stacked: str, expert: int,
                    projection: str) -> torch.Tensor | QuantizedWeight:
        blocks = self._stacked(prefix, f"{stacked}_blocks")[expert]  # [out, groups, 16]
        scales = self._stacked(prefix, f"{stacked}_scales")[expert]  # [out, groups]
        if projection != "down":
            rows = slice(0, None, 2) if projection == "gate" else slice(1, None, 2)
            blocks, scales = blocks[rows], scales[rows]
        weight = repack(gguf.GGMLQuantizationType.MXFP4, gguf_mxfp4_blocks(blocks, scales),
                        (blocks.shape[0], blocks.shape[1] * 32))
        return weight.dequantize() if self._dequantize else weight

    def _stacked(self, prefix: str, name: str) -> torch.Tensor:
        if self._layer[0] != prefix:
            self._layer = (prefix, {})
        tensors = self._layer[1]
        if name not in tensors:
            tensors[name] = self._get(f"{prefix}.{name}")
        return tensors[name]


def gguf_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """transformers' MXFP4 rows (blocks [N, G, 16]: byte j holds codes 2j low and 2j + 1 high;
    scales [N, G]) as GGUF's MXFP4 bytes [N, G * 17] (per block the exponent, then byte j holding
    codes j low and j + 16 high). Both formats read the exponent and the codes alike."""
    packed = blocks.numpy().astype(np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:2], 32)
    gguf_order = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales.numpy().astype(np.uint8)[..., None], gguf_order], axis=-1)
    return out.reshape(packed.shape[0], -1)
