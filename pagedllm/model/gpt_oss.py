"""gpt-oss's stacked experts in a Hugging Face folder, read as one expert's tensors at a time.

transformers stores each layer's experts in four tensors: gate_up_proj [E, hidden, 2I] (inputs
first, the gate and up columns interleaved: gate is every even column, up every odd one),
gate_up_proj_bias [E, 2I] (interleaved alike), down_proj [E, I, hidden] and down_proj_bias
[E, hidden]. The model holds each expert as an ordinary MLP (model/moe.py), so the loader asks
for the per-expert names a GGUF file's stacked tensors also give (gguf_file.py), and this view
cuts them out: mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}, weights as [out, in]. Every other
tensor passes through under its own name.

The released checkpoints store the expert weights as MXFP4 (*_blocks and *_scales); those are
refused here, naming the tensor: their GGUF conversion loads (gguf_file.py keeps MXFP4 quantized).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from pagedllm.model.errors import UnsupportedModelError

_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
_MXFP4 = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\w+_(blocks|scales)")
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)")


class UnstackedExperts:
    """names and get() of a checkpoint's tensors (SafetensorsWeights' interface), each stacked
    experts tensor replaced by its num_experts experts' own."""

    def __init__(self, names: set[str], get: Callable[[str], torch.Tensor], num_experts: int):
        mxfp4 = sorted(n for n in names if _MXFP4.fullmatch(n))
        if mxfp4:
            raise UnsupportedModelError(
                f"tensor {mxfp4[0]}: MXFP4 expert weights in a Hugging Face folder are not supported; "
                "load the model's GGUF conversion (llama.cpp's convert_hf_to_gguf.py keeps them MXFP4)")
        self._get = get
        # The stacked tensors of the layer read last: the loader asks for a layer's experts in turn.
        self._layer: tuple[str, dict[str, torch.Tensor]] = ("", {})
        self.names = set()
        for name in names:
            match = _STACKED.fullmatch(name)
            if match is None:
                self.names.add(name)
                continue
            prefix, kind = match[1], "bias" if match[3] else "weight"
            projections = ("gate", "up") if match[2] == "gate_up_proj" else ("down",)
            self.names.update(f"{prefix}.{e}.{p}_proj.{kind}"
                              for p in projections for e in range(num_experts))

    def get(self, name: str) -> torch.Tensor:
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            return self._get(name)
        prefix, expert, projection, kind = match[1], int(match[2]), match[3], match[4]
        stacked = "gate_up_proj" if projection in ("gate", "up") else "down_proj"
        tensor = self._stacked(prefix, f"{stacked}{'_bias' if kind == 'bias' else ''}")[expert]
        if kind == "weight":
            tensor = tensor.t()  # stored [in, out]
        if projection != "down":
            tensor = tensor[0::2] if projection == "gate" else tensor[1::2]
        return tensor.contiguous()

    def _stacked(self, prefix: str, name: str) -> torch.Tensor:
        if self._layer[0] != prefix:
            self._layer = (prefix, {})
        tensors = self._layer[1]
        if name not in tensors:
            tensors[name] = self._get(f"{prefix}.{name}")
        return tensors[name]
