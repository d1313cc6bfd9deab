"""SentencePiece GGUF vocabularies (Llama 2, Mistral, TinyLlama, Phi-3, Gemma) tokenize exactly as
transformers' GGUF tokenizer does, on a tiny vocabulary with byte fallback written with gguf's
writer: spaces, digits, emoji, rare bytes, special and user-defined tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.model.gguf_file import GGUFCheckpoint
from pagedllm.text.sentencepiece_vocab import merges_by_rank
from pagedllm.text.tokenizer import Tokenizer

# Pieces in score order, best first: whole words, their parts, digits, runs of spaces; everything
# else (emoji, accents, CJK, control bytes) falls back to <0xXX> byte tokens.
PIECES = ["▁", "▁t", "h", "e", "▁th", "▁the", "t", "a", "▁a", "n", "d", "▁an", "▁and", "1", "2",
          "3", "12", "▁1", "▁12", "o", "l", "lo", "▁hel", "he", "▁he", "ll", "llo", "▁hello", "w",
          "r", "▁w", "or", "ld", "▁wor", "▁world", "é", "▁é", "0", "4", "5", "6", "7", "8", "9",
          ",", ".", "!", "▁▁", "▁▁▁▁", "  ", "s", "p", "c", "i", "g", "▁s", "▁sp", "ace", "ac", "ce"]
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
TOKENS = [UNK, BOS, EOS] + [f"<0x{b:02X}>" for b in range(256)] + PIECES + ["<|user|>", "<|end|>"]
# llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [4, 3]
SCORES = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0, 0.0]

STRINGS = [
    "hello world", "  leading spaces", "trailing  ", "multiple   spaces  here", "a\tb\nc",
    "hello\n\nworld", "12345 678", "The and the 1,2,3!", "emoji 😀🚀 done 👍🏽",
    "rare \x01\x7f é ü ß 中文", "", " ", "space ace", "<|user|>hello<|end|>",
    "<s>literal</s> <unk>",
]


def write_vocab(path: Path, architecture: str, **extra) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_scores(SCORES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_space_prefix" in extra:
        writer.add_add_space_prefix(extra["add_space_prefix"])
    writer.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Llama's own shape, Phi-3's (the prefix space from a normalizer) and Gemma's (no prefix space,
# merges in file order).
@pytest.fixture(scope="module", params=["llama", "phi3", "gemma2"])
def tokenizers_pair(request, tmp_path_factory):
    """(ours, transformers') for one SentencePiece GGUF."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(request.param)
    path = write_vocab(folder / "vocab.gguf", request.param)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    return Tokenizer.from_gguf(GGUFCheckpoint(path).metadata), theirs


@pytest.mark.parametrize("text", STRINGS)
def test_tokenizes_as_transformers(tokenizers_pair, text):
    ours, theirs = tokenizers_pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_byte_fallback_and_stream_decoding(tokenizers_pair):
    ours, _ = tokenizers_pair
    text = "é 😀 中"  # é is a piece; the emoji and the CJK character are bytes
    ids = ours.encode(text, add_special_tokens=False)
    byte_ids = [i for i in ids if TOKENS[i].startswith("<0x")]
    assert len(byte_ids) == 4 + 3  # 😀 is four bytes, 中 three
    assert ours.decode(ids) == text
    detok = ours.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in delta for delta in deltas)  # no half characters shown


def test_special_tokens_and_end_of_turn(tmp_path):
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(write_vocab(tmp_path / "v.gguf", "llama")).metadata)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    # <|end|> is a control token that ends a turn: llama.cpp stops there too.
    assert tokenizer.eos_token_ids == [2, TOKENS.index("<|end|>")]
    assert tokenizer.encode("hi")[0] == 1  # BOS by default for SentencePiece files


def test_file_without_space_prefix(tmp_path):
    # llama.cpp honours add_space_prefix = false (transformers would still prefix a space).
    path = write_vocab(tmp_path / "v.gguf", "llama", add_space_prefix=False)
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(path).metadata)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert [TOKENS[i] for i in ids] == ["he", "llo", "▁world"]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(tokenizer.encode(" hello")) == " hello"  # a real leading space stays


def test_merges_rank_by_the_merged_piece():
    vocab = {piece: i for i, piece in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    ranks = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -2.0, "bc": -1.0, "abc": -3.0}
    # bc scores best; abc splits two ways, the longer left part first.
    assert merges_by_rank(vocab, ranks) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_vocabulary_without_scores_is_refused(tmp_path):
    metadata = dict(GGUFCheckpoint(write_vocab(tmp_path / "v.gguf", "llama")).metadata)
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(metadata)
