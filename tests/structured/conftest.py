"""Tokenizers and compilers for the structured-output tests: the default model's (SmolLM2's
49,152-token byte-level BPE, built from its GGUF vocabulary) and the tiny byte tokenizer."""

from __future__ import annotations

import pytest

from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import BOS, EOS, tokenizer_backend


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_path) -> Tokenizer:
    from pagedllm.model.tokenizer_files import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def smol_compiler(smol_tokenizer):
    compiler = GrammarCompiler(smol_tokenizer)
    yield compiler
    compiler.close()


def make_tiny_tokenizer() -> Tokenizer:
    """256 byte tokens, then BOS (256) and EOS (257)."""
    return Tokenizer(tokenizer_backend(), {"bos_token": BOS, "eos_token": EOS})


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()
