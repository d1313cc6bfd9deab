"""Constrained decoding through the engine on a tiny random model (whose unconstrained output is
noise, so every valid answer is the grammar's doing): each kind of constraint, greedy and sampled,
n > 1 children each in their own grammar state, preemption and prefix caching, min_tokens and
ignore_eos against a grammar that is complete, stop strings, streaming, requests that wait in the
core for their grammar, and a chooser that picks a token the grammar refuses."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from pagedllm.engine.input_processor import InvalidInput
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured.compiler import GrammarError
from pagedllm.structured.spec import GrammarSpec

PROMPT = "hello there"
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["apple", "banana", "cherry", "date"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    torch.set_num_threads(1)
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64,
               enable_prefix_caching=False)


def texts(llm: LLM, params: SamplingParams | list[SamplingParams], prompts=(PROMPT,)) -> list[tuple]:
    """(text, finish_reason) of every output of every prompt."""
    return [(o.text, o.finish_reason) for r in llm.generate(list(prompts), params, use_tqdm=False)
            for o in r.outputs]


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return text in ("yes", "no")
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


SPECS = {"regex": {"regex": REGEX}, "choice": {"choice": CHOICES}, "json": {"json": SCHEMA},
         "grammar": {"grammar": 'root ::= "yes" | "no"'}}


@pytest.mark.parametrize("kind", SPECS)
def test_each_kind_constrains_greedy_and_sampled_output(llm, kind):
    free = texts(llm, SamplingParams(temperature=0, max_tokens=30))
    assert not valid(kind, free[0][0])  # the model alone writes noise
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40, structured_outputs=SPECS[kind])
              for t in (0, 1.0, 3.0) for s in range(3)]
    for text, finish in texts(llm, params, [PROMPT] * len(params)):
        assert finish == "stop" and valid(kind, text), text


def test_n_children_each_keep_their_own_grammar_state(llm):
    """The first token fans out from one row of logits: each child's matcher starts from the
    state before it, so children that chose different first letters all finish a choice."""
    outputs = texts(llm, SamplingParams(n=8, temperature=5.0, seed=3, max_tokens=10,
                                        structured_outputs={"choice": CHOICES}))
    assert all(finish == "stop" and text in CHOICES for text, finish in outputs)
    assert len({text for text, _ in outputs}) > 1


def test_preemption_and_prefix_caching_leave_greedy_output_unchanged(tiny_model_dir, llm):
    prompts = [f"{PROMPT} {i}" * 2 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": "[a-z ]{10,20}"})
    alone = [texts(llm, params, [p])[0] for p in prompts]
    for kwargs in (dict(num_kv_blocks=20), dict(num_kv_blocks=64, enable_prefix_caching=True)):
        other = LLM(model=str(tiny_model_dir), dtype="float32", block_size=4, **kwargs)
        assert texts(other, params, prompts) == alone
        assert texts(other, params, prompts) == alone  # again: prefix hits with caching on
        if kwargs["num_kv_blocks"] == 20:
            assert other.memory_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("extra", [dict(min_tokens=5), dict(ignore_eos=True),
                                   dict(min_tokens=5, ignore_eos=True),
                                   dict(min_tokens=5, stop_token_ids=[ord("b")])])
def test_a_complete_grammar_ends_the_output_despite_min_tokens_and_ignore_eos(llm, extra):
    """The grammar is complete after "ab": the sequence ends there ("stop"), with ignore_eos
    too, and before min_tokens. After "a" it allows only "b": a stop token that min_tokens bans
    still gets drawn, as the grammar wins (never a row with nothing to draw)."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, structured_outputs={"choice": ["ab"]},
                            **extra)
    assert texts(llm, params) == [("ab", "stop")]


def test_stop_strings_cut_constrained_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, stop=["ca"],
                            structured_outputs={"regex": "abcabcabc"})
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert (output.text, output.finish_reason, output.stop_reason) == ("ab", "stop", "ca")


def test_streamed_deltas_join_to_the_whole_text(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA})
    whole = texts(llm, params)[0][0]
    streamed = SamplingParams(**{**vars(params), "output_kind": RequestOutputKind.DELTA})
    engine.add_request("stream", PROMPT, streamed)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step() if o.outputs]
    assert "".join(pieces) == whole and valid("json", whole)


def test_logprobs_are_of_the_constrained_distribution(llm):
    """Only allowed tokens have probability; a forbidden one is no alternative (no -inf)."""
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5,
                            structured_outputs={"choice": ["ab", "ac"]})
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    first, second = output.logprobs[0], output.logprobs[1]
    assert list(first) == [ord("a")] and first[ord("a")].logprob == pytest.approx(0.0)
    assert set(second) == {ord("b"), ord("c")}
    assert sum(torch.tensor([lp.logprob for lp in second.values()]).exp()) == pytest.approx(1.0)


def test_bad_structured_outputs_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(InvalidInput, match="invalid regex") as refused:
        llm.generate([PROMPT], SamplingParams(structured_outputs={"regex": "(open"}), use_tqdm=False)
    assert refused.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


class GatedCompiler:
    """Compiles with the real compiler once `gate` is set (a core in another process, compiling
    what it receives); `fail` makes the result a GrammarError instead."""

    def __init__(self, real, fail: bool = False):
        self.real, self.fail, self.gate = real, fail, threading.Event()

    def submit(self, spec: GrammarSpec) -> Future:
        future: Future = Future()

        def finish():
            self.gate.wait()
            if self.fail:
                future.set_exception(GrammarError("injected"))
            else:
                future.set_result(self.real.compile(spec))

        threading.Thread(target=finish, daemon=True).start()
        return future


@pytest.fixture
def gated(llm, monkeypatch):
    def install(fail: bool = False) -> GatedCompiler:
        structured = llm.engine.engine_core.structured
        compiler = GatedCompiler(llm.engine.grammar_compiler, fail)
        monkeypatch.setattr(structured, "_compiler", compiler)
        return compiler

    yield install
    assert not llm.engine.has_unfinished_requests()


def test_a_request_waits_in_the_core_until_its_grammar_compiles(llm, gated):
    compiler = gated()
    core = llm.engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": REGEX})
    core.add_request(EngineCoreRequest("waits", [104, 105], params, (), 0.0))
    assert core.step().outputs == [] and core.stats().num_waiting == 1
    compiler.gate.set()
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
            finish = out.finish_reason
    assert finish == "stop" and valid("regex", llm.get_tokenizer().decode(tokens))


def test_a_grammar_that_fails_in_the_core_ends_every_output(llm, gated):
    compiler = gated(fail=True)
    engine = llm.engine
    engine.add_request("fails", PROMPT, SamplingParams(n=2, structured_outputs={"regex": "x+"}))
    compiler.gate.set()
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.text, o.finish_reason) for o in finals[0].outputs] == [("", "abort"), ("", "abort")]


def test_the_chooser_sees_masked_logits_and_a_refused_token_ends_the_sequence(llm):
    core = llm.engine.engine_core
    params = SamplingParams(max_tokens=5, structured_outputs={"choice": ["xy"]})
    llm.engine.grammar_compiler.compile(params.structured_outputs)  # so the core need not wait
    core.add_request(EngineCoreRequest("picky", [104, 105], params, (), 0.0))
    seen = []

    def choose(logits, rows):
        seen.append(torch.isfinite(logits[0]).nonzero().flatten().tolist())
        return [[ord("z")]]

    outputs = core.step(choose).outputs
    assert seen == [[ord("x")]]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([ord("z")], "abort")]
    assert not core.has_unfinished_requests()


def test_a_core_without_a_compiler_refuses_constrained_requests(llm, monkeypatch):
    core = llm.engine.engine_core
    monkeypatch.setattr(core.structured, "_compiler", None)
    params = SamplingParams(structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match="without a grammar compiler"):
        core.add_request(EngineCoreRequest("no", [104], params, (), 0.0))
    assert not core.has_unfinished_requests()


def test_beam_search_still_runs_beside_the_grammar_code(llm):
    (result,) = llm.beam_search([PROMPT], beam_width=3, max_tokens=4)
    assert len(result.sequences) == 3


def test_engine_core_request_carries_the_spec_as_plain_data():
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert params.structured_outputs == GrammarSpec.json_schema(SCHEMA)
    assert isinstance(params.structured_outputs.text, str)


def test_engine_made_twice_shares_nothing(tiny_model_dir):
    """Each engine has its own compiler (no global state)."""
    a = LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16)
    b = LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16)
    assert a.grammar_compiler is not b.grammar_compiler
    assert a.input_processor.grammar_compiler is a.grammar_compiler
