"""vLLM's /tokenizer_info: the tokenizer's settings in tokenizer_config.json's shape, for clients
that tokenize on their side (and must agree with the server). Off unless the server is started
with --enable-tokenizer-info-endpoint, as in vLLM: it shows the chat template."""

from __future__ import annotations

from typing import Any

from pagedllm.text.tokenizer import Tokenizer

# The class transformers builds from a tokenizer.json or a GGUF vocabulary (what this server
# tokenizes with: the same `tokenizers` backend).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def tokenizer_info(tokenizer: Tokenizer, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    """chat_template: the one chats render with (the server's, else the model's)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    info: dict[str, Any] = {
        "tokenizer_class": TOKENIZER_CLASS,
        **{name: text for name, text in tokenizer.special_tokens.items() if text is not None},
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "added_tokens_decoder": {str(token_id): {"content": token.content, "special": token.special}
                                 for token_id, token in sorted(added.items())},
    }
    template = chat_template or tokenizer.chat_template
    if template:
        info["chat_template"] = template
    return info
