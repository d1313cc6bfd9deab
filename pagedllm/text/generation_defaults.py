"""The sampling defaults a model ships in its generation_config.json (Llama 3 Instruct: temperature
0.6, top_p 0.9), used wherever a request leaves a field unset, as vLLM does by default. Its
max_new_tokens becomes the default max_tokens: a server request that gives none gets the room left
in the context or that, whichever is less (InputProcessor.process).

`generation_config` (EngineConfig, `--generation-config`) says where they come from: "auto" (the
model folder's generation_config.json), "vllm" or "none" (no model defaults: SamplingParams' own),
or a folder holding a generation_config.json. The end-of-generation ids in the same file are the
tokenizer's business (Tokenizer.eos_token_ids), whatever this setting says.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's sampling fields that become defaults (the same names in SamplingParams).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json's names for SamplingParams fields named otherwise.
RENAMED_FIELDS = {"max_new_tokens": "max_tokens"}
NO_MODEL_DEFAULTS = ("vllm", "none")


def read_generation_defaults(setting: str, model_path: Path) -> dict:
    """The sampling defaults to apply (field -> value); {} when there are none."""
    if setting in NO_MODEL_DEFAULTS:
        return {}
    if setting == "auto":
        file = Path(model_path) / "generation_config.json"
        if not file.is_file():  # a GGUF file, or a folder without one
            return {}
    else:
        file = Path(setting).expanduser() / "generation_config.json"
        if not file.is_file():
            raise ValueError(f"generation_config {setting!r}: no generation_config.json in that "
                             "folder; give 'auto', 'vllm', 'none' or such a folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    defaults = {name: config[name] for name in GENERATION_CONFIG_FIELDS if config.get(name) is not None}
    defaults.update({ours: config[theirs] for theirs, ours in RENAMED_FIELDS.items()
                     if config.get(theirs) is not None})
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc} (--generation-config none ignores the file)") from None
    if defaults:
        logger.info("sampling defaults from %s, for requests that leave them unset: %s", file, defaults)
    return defaults
