"""The prompt a causal reranker judges a (query, document) pair under: Qwen3-Reranker's format,
from its model card. The model is asked whether the document meets the query and answers "yes" or
"no"; the score is P("yes") against P("no") at the prompt's last token (PoolingParams "score",
the labels being EngineConfig.score_tokens). The assistant's turn is opened with an empty
thinking block, so the next token is the verdict itself.

The format's control tokens (<|im_start|>, ...) act as such; the user's texts (instruction, query,
document) are plain: a control token written in them is tokenized as its characters, as in a chat
message, so a document cannot forge a turn.
"""

from __future__ import annotations

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
           "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
           "<|im_start|>user\n")
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def score_prompt(query: str, document: str,
                 instruction: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The text the reranker reads for one pair (instruction None: the model card's default), and
    the character spans of the user's texts in it (Tokenizer.encode's plain_spans)."""
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    pieces = [_PREFIX, "<Instruct>: ", instruction, "\n<Query>: ", query, "\n<Document>: ", document,
              _SUFFIX]
    spans, at = [], 0
    for i, piece in enumerate(pieces):
        if i in (2, 4, 6):  # the user's
            spans.append((at, at + len(piece)))
        at += len(piece)
    return "".join(pieces), spans
