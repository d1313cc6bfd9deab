"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar, and
the tool-calling pieces built on it.

One concept per module:
- spec: every request form (response_format, structured_outputs, guided_*) -> a GrammarSpec,
  plain hashable data, bounded in size before anything is built;
- schema: what the grammar assumes where a JSON schema is silent (closed objects, safe integers);
- compiler: GrammarSpec -> CompiledGrammar for one tokenizer, bounded in time, cached;
- matcher: one sequence's grammar state (accept, fork, replay, rollback, can_end);
- bitmask: a step's batched token bitmask, filled from the matchers, applied to the logits;
- manager: the engine core's side: compiles for added requests (holding them back while a
  compile runs), masks the logits of a step's sampling rows;
- tools: tools / tool_choice checked, the schema that forces valid calls, the fallback prompt;
- tool_parsers: model text -> OpenAI tool_calls, streaming.

How the engine uses it: SamplingParams.structured_outputs holds the GrammarSpec (the server makes
it from the request's fields or its tools, pagedllm/server/structured.py); the input processor
compiles it (GrammarError -> 400); the engine core (engine/core.py, manager.py) gives each
sequence a matcher (forked for n > 1 and beams), masks every sampling row's logits before the
sampler, advances the matcher with the kept token and finishes a sequence whose grammar is done:
    compiler = GrammarCompiler(tokenizer)                    # per engine; tokenizer view on first use
    matcher = compiler.compile(spec).matcher()               # per sequence; fork() per child
    bitmask = allocate_token_bitmask(len(rows), compiler.vocab_size)
    filler.fill(bitmask, [(matcher_of(row), i) for i, row in enumerate(rows)])
    apply_token_bitmask_(logits, bitmask, compiler.vocab_size, rows=rows)   # before sampling
    matcher.accept_token(token)   # False: end the sequence; then matcher.is_terminated: finish

Why llguidance (against xgrammar and outlines-core), measured on this machine (2 shared cores,
load 8-13, so read ratios, not absolutes), with SmolLM2's 49,152-token vocabulary built by our
Tokenizer from the GGUF file, each library's batched fill (llguidance's LLExecutor,
xgrammar's BatchGrammarMatcher, a loop for outlines-core), N matchers each walking its own valid
answer, mean fill time per step over 200 steps:

    per step, ms          N=1     N=16    N=64    compile: 7-field   120-field  tokenizer
    llguidance  json      0.07    0.84    3.1              1.7 ms     24 ms     0.5 s
                regex     0.10    1.38    5.3
                choice    0.007   0.62    1.9
    xgrammar    json      0.02    0.33    1.4              28 ms      499 ms    0.6 s
                regex     0.002   0.32    0.77
                choice    0.001   0.10    0.38
    outlines    json      0.05    1.33    5.2              2.0 s      40 s      3.0 s
    -core       regex     0.03    0.73    2.8
                choice    0.002   0.06    0.13

(compile = the build plus the first mask; the 120-field schema has enums, bounded integers,
patterns and arrays of objects.) xgrammar fills masks 2-7x faster, but:
- compile: llguidance builds lazily, 20x faster; a new schema's compile is a request's wait
  before its first token, and a pathological one is where a server gets stuck. llguidance also
  bounds its own work (LLParserLimits: grammar size, lexer fuel and states) and fails with a
  message; xgrammar has no such limits.
- dependencies: llguidance is one 3 MB abi3 wheel with no dependencies; xgrammar requires torch,
  transformers at run time (a test-only dependency here), apache-tvm-ffi and, on Linux x86_64,
  triton, a GPU compiler of hundreds of MB useless on a CPU.
- tokenizers: llguidance reads the `tokenizers` backend's JSON, which our Tokenizer has for HF
  folders and GGUF vocabularies alike; xgrammar wants a transformers tokenizer object (ours must
  be wrapped in PreTrainedTokenizerFast) or a hand-decoded vocabulary.
- JSON schema coverage: llguidance implements more of the standard (it serves OpenAI's own
  structured outputs) and names what it does not ("Unimplemented keys: [...]").
- both support rollback and forking; both are permissively licensed (llguidance MIT, xgrammar
  Apache-2.0, outlines-core Apache-2.0). outlines-core has no context-free grammars at all and
  compiles a schema to a regex DFA up front (2-40 s here).
The fill cost is the price: 3-8 ms at 64 JSON-constrained rows (by load) against an 88 ms
decode step of 64 SmolLM2 requests (docs/benchmarks-notebook.md), 4-9%. The bitmask's layout is the
same in all three, so changing the library means changing compiler.py and matcher.py only.
"""

# No re-exports: `import pagedllm` reaches pagedllm.structured.spec through SamplingParams, and
# importing the package must not load llguidance and torch (the API server process has no torch).
