"""The structured-output bench on the tiny tokenizer: every kind's answers are accepted by its
grammar for as many steps as asked, and each batch size gets a row (timings are the bench's job)."""

import json

import pytest

from pagedllm.bench import structured as bench
from pagedllm.structured.compiler import GrammarCompiler
from tests.structured.conftest import make_tiny_tokenizer


def test_every_answer_is_valid_for_its_grammar():
    tokenizer = make_tiny_tokenizer()
    compiler = GrammarCompiler(tokenizer)
    try:
        for kind, spec in bench.SPECS.items():
            for i in range(12):
                matcher = compiler.matcher(spec)
                ids = tokenizer.encode(bench.answer(kind, i), add_special_tokens=False)
                assert matcher.accept_tokens(ids) and matcher.can_end, (kind, i, matcher.error)
        json.loads(bench.answer("json", 5))
    finally:
        compiler.close()


def test_run_gives_a_row_per_kind_and_batch_size():
    results = bench.run(make_tiny_tokenizer(), ["json", "choice"], [1, 3], steps=40, pool_threads=2)
    assert [(r.kind, r.matchers, r.steps) for r in results] == [
        ("json", 1, 40), ("json", 3, 40), ("choice", 1, 40), ("choice", 3, 40)]
    for r in results:
        assert min(r.compile_ms, r.fill_loop_ms, r.fill_batched_ms, r.apply_ms, r.accept_ms) >= 0
        assert r.total_ms == pytest.approx(r.fill_batched_ms + r.apply_ms + r.accept_ms)
