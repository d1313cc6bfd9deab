"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model == "llama"`: Llama 2,
Mistral, TinyLlama, Gemma, Phi-3) as a `tokenizers` BPE model with byte fallback, built the way
transformers builds it from the same file, so both tokenize alike.

GGUF stores the pieces and their scores but no merges. SentencePiece's BPE merges the pair whose
result scores highest, so ranking every pair of pieces that spells a piece by that piece's score
gives the merge list. Spaces are the metaspace "▁", put in by the pre-tokenizer (or, for Gemma
and Phi-3, by a normalizer), and pieces missing from the vocabulary fall back to <0xXX> byte
tokens.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # "▁"

_GEMMA = ("gemma", "gemma2", "gemma3")


def sentencepiece_from_gguf(metadata: dict[str, Any]) -> tokenizers.Tokenizer:
    """The BPE model with its normalizer, pre-tokenizer and decoder; the caller adds the special
    tokens and the BOS/EOS post-processor, as for every GGUF vocabulary."""
    architecture = metadata.get("general.architecture")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    if architecture in _GEMMA:
        # Gemma files store its tokens of two or more spaces as real spaces; its scores do not
        # follow its merge order, the order of the tokens in the file does.
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("the GGUF SentencePiece vocabulary needs one score per token "
                             "(tokenizer.ggml.scores); the file's is missing or of another length")
        ranks = dict(zip(tokens, scores))
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = merges_by_rank(vocab, ranks)
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    metaspace_decoder = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if architecture in _GEMMA:  # no space prefix: spaces are marked where they are
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(metaspace_decoder)
        return backend
    # llama.cpp honours a file that says its text takes no space prefix (transformers does not);
    # Phi-3's prefix comes from a normalizer, as its tokenizer.json has it.
    prefix = architecture == "phi3" or metadata.get("tokenizer.ggml.add_space_prefix", True)
    if architecture == "phi3":
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        backend.pre_tokenizer = None
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
    # The prefix space is dropped again when decoding.
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(metaspace_decoder + strip)
    return backend


def merges_by_rank(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-ranked piece first (ties:
    longer left part, then longer right part, then the vocabulary's order), as transformers'
    generate_merges orders them."""
    merges = []
    for piece, rank in ranks.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, rank) for left, right in splits)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
