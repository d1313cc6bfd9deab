"""The compiler: every kind compiles against real vocabularies (GGUF-built, HF folder, tiny),
results and failures are cached per spec, and what cannot compile, or not in time, is a
GrammarError (a ValueError) with the library's message."""

import json
import threading

import pytest

from pagedllm.structured.compiler import GrammarCompiler, GrammarError, check_grammar, llguidance_tokenizer
from pagedllm.structured.spec import GrammarSpec
from pagedllm.text.tokenizer import Tokenizer
from tests.model.tiny import write_tokenizer


def _accepts(compiler, spec, text, tokenizer) -> bool:
    matcher = compiler.matcher(spec)
    return matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.can_end


@pytest.mark.parametrize("spec, good, bad", [
    (GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                              "required": ["n"], "additionalProperties": False}),
     '{"n": 42}', '{"n": "42"}'),
    (GrammarSpec.json_object(), '{"any": [1, true, null]}', "[1, 2]"),
    (GrammarSpec.json_object("compact"), '{"a":1}', '{"a": 1}'),
    (GrammarSpec.regex(r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
    (GrammarSpec.choice(["red", "green", 'say "hi"']), 'say "hi"', "blue"),
    (GrammarSpec.grammar('root ::= "yes" | "no" ws\nws ::= " "?'), "no ", "maybe"),  # GBNF
    (GrammarSpec.grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x12", "x"),  # Lark
])
def test_each_kind_compiles_and_constrains(smol_compiler, smol_tokenizer, spec, good, bad):
    assert _accepts(smol_compiler, spec, good, smol_tokenizer)
    assert not _accepts(smol_compiler, spec, bad, smol_tokenizer)


def test_spaced_json_is_the_default(smol_compiler, smol_tokenizer):
    spec = GrammarSpec.json_object()
    assert _accepts(smol_compiler, spec, '{"a": 1, "b": 2}', smol_tokenizer)
    assert not _accepts(smol_compiler, spec, '{"a":1}', smol_tokenizer)
    assert not _accepts(smol_compiler, spec, '{\n  "a": 1\n}', smol_tokenizer)
    assert _accepts(smol_compiler, GrammarSpec.json_object("flexible"), '{\n  "a": 1\n}', smol_tokenizer)


def test_results_and_failures_are_cached_per_spec(smol_compiler):
    spec = GrammarSpec.regex("cache-me-[0-9]")
    assert smol_compiler.compile(spec) is smol_compiler.compile(GrammarSpec.regex("cache-me-[0-9]"))
    bad = GrammarSpec.json_schema({"type": "integer", "minimum": "zero"})
    assert smol_compiler.submit(bad) is smol_compiler.submit(bad)
    with pytest.raises(GrammarError, match="invalid json schema: .*minimum"):
        smol_compiler.compile(bad)


def test_cache_is_bounded(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, cache_size=2)
    try:
        first = compiler.compile(GrammarSpec.regex("a"))
        compiler.compile(GrammarSpec.regex("b"))
        compiler.compile(GrammarSpec.regex("c"))
        assert compiler.compile(GrammarSpec.regex("a")) is not first  # evicted, built again
    finally:
        compiler.close()


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec.json_schema({"type": "foo"}), "invalid json schema: Invalid type: foo"),
    (GrammarSpec.json_schema({"type": "object", "dependentRequired": {"a": ["b"]}}),
     "invalid json schema: Unimplemented keys"),
    (GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "invalid json schema: .*missing"),
    (GrammarSpec.regex("[a-"), "invalid regex: .*unclosed character class"),
    (GrammarSpec.grammar('root ::= "a" | ('), "invalid grammar: Failed to convert"),
    (GrammarSpec.grammar("start: undefined_rule"), "invalid grammar: .*undefined_rule"),
])
def test_what_does_not_compile_is_a_grammar_error(smol_compiler, spec, message):
    with pytest.raises(GrammarError, match=f"(?s){message}") as info:
        smol_compiler.compile(spec)
    assert isinstance(info.value, ValueError) and len(str(info.value)) < 600
    with pytest.raises(GrammarError, match=f"(?s){message}"):
        check_grammar(spec)  # the same verdict without a tokenizer


def test_a_compile_over_the_time_limit_fails_and_is_remembered(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, compile_timeout_s=1e-6)
    try:
        spec = GrammarSpec.json_schema({"type": "object", "properties": {
            f"p{i}": {"enum": [f"v{i}_{j}" for j in range(20)]} for i in range(200)}})
        with pytest.raises(GrammarError, match="took longer than 1e-06 s"):
            compiler.compile(spec)
        assert compiler.submit(spec).exception() is not None  # failed at once, not built again
    finally:
        compiler.close()


def test_a_timeout_while_the_pool_was_busy_is_not_the_schemas_verdict(tiny_tokenizer):
    """Issue 32, finding 6: while other builds occupy the compilers, an ordinary schema times
    out waiting; that request gets its 400, and the same schema sent once the pool is free
    compiles (it used to be refused for good, the wait cached as its failure)."""
    compiler = GrammarCompiler(tiny_tokenizer, compile_timeout_s=0.5, max_threads=1)
    try:
        compiler.compile(GrammarSpec.json_schema({"type": "string"}))  # the tokenizer built
        release = threading.Event()
        blocker = compiler._pool.submit(release.wait)  # a long build holding the only thread
        spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        with pytest.raises(GrammarError, match="busy with other requests: send it again"):
            compiler.compile(spec)
        release.set()
        blocker.result()
        assert compiler.compile(spec).spec == spec
    finally:
        compiler.close()


def test_tokenizers_from_gguf_and_hf_folders(tmp_path, smol_tokenizer):
    write_tokenizer(tmp_path)
    hf = Tokenizer.from_hf_folder(tmp_path)
    for tokenizer in (hf, smol_tokenizer):
        ll = llguidance_tokenizer(tokenizer)
        assert ll.vocab_size == tokenizer.vocab_size
        assert ll.eos_tokens == tokenizer.eos_token_ids
        compiler = GrammarCompiler(tokenizer)
        try:
            schema = GrammarSpec.json_schema({"enum": ["ok"]})
            assert _accepts(compiler, schema, json.dumps("ok"), tokenizer)
        finally:
            compiler.close()


def test_bad_compiler_settings(tiny_tokenizer):
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarCompiler(tiny_tokenizer, compile_timeout_s=0)
