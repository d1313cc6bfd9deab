"""The engine core's side of structured outputs: the compiled grammar of each constrained request,
and each step's token bitmask over the rows that sample.

The core keeps one GrammarMatcher per sequence (CoreSequence.matcher) and advances it with each
token the sequence keeps; this class turns the matchers of a step's rows into masked logits. The
spec crosses into the core as plain data (SamplingParams.structured_outputs); the core compiles
it with its own compiler, which in one process is the input processor's, so the compile the
input processor waited for is a cache hit here. A core in a process of its own compiles what
it receives: submit() never waits, and the core holds a request back until its grammar is ready.

Where the mask goes: on the logits of the rows that sample, before anything else reads them
(the sampler's penalties, min_tokens and temperature, or a chooser such as beam search), so
every path draws only tokens the grammar allows and the log-probabilities handed out are those
of the constrained distribution (as vLLM's). An n > 1 prompt's first sample fans out from one
row of logits, masked once by sequence 0's matcher: every child starts from that same state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from pagedllm.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_
from pagedllm.structured.compiler import CompiledGrammar, GrammarCompiler
from pagedllm.structured.matcher import BitmaskFiller, GrammarMatcher
from pagedllm.structured.spec import GrammarSpec


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler | None, filler: BitmaskFiller | None = None):
        self._compiler = compiler
        self._filler = filler or BitmaskFiller()
        self._compiling: dict[str, Future[CompiledGrammar]] = {}  # by request id

    # -- requests ------------------------------------------------------------------------------
    def start(self, request_id: str, spec: GrammarSpec) -> GrammarMatcher | None:
        """A matcher for the request's first sequence if its grammar is compiled already; None
        while it compiles (ready() hands it over later). A ValueError (GrammarError) if the
        grammar failed, or if this core has no compiler."""
        if self._compiler is None:
            raise ValueError("this engine core was made without a grammar compiler, so it cannot "
                             f"take a request constrained to a {spec.kind}")
        future = self._compiler.submit(spec)
        if future.done():
            return future.result().matcher()
        self._compiling[request_id] = future
        return None

    def ready(self) -> Iterator[tuple[str, GrammarMatcher | Exception]]:
        """(request id, its matcher, or why its grammar failed) for each compile now done."""
        for request_id, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[request_id]
                try:
                    yield request_id, future.result().matcher()
                except Exception as exc:  # a GrammarError, or a bug: the request cannot run
                    yield request_id, exc

    def wait(self, timeout_s: float) -> None:
        """Sleep until a compile finishes or timeout_s passes (a core with nothing else to do)."""
        if self._compiling:
            wait(list(self._compiling.values()), timeout_s, FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        """The request ended while its grammar compiled (the compile goes on, for the cache)."""
        self._compiling.pop(request_id, None)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    # -- the step ------------------------------------------------------------------------------

    @torch.inference_mode()  # the runner's logits are inference tensors: written in that mode
    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """The logits with each row whose matcher is not None keeping only the tokens its grammar
        allows next (-inf elsewhere); the other rows as they were. Float32 where any row is
        masked (the sampler works in float32 anyway; on the CPU the mask is added in float32 by
        numpy, bitmask.py says why), in place when they were float32 already."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return logits
        logits = logits.float()
        vocab_size = matchers[rows[0]].vocab_size
        bitmask = allocate_token_bitmask(len(rows), vocab_size)
        self._filler.fill(bitmask, [(matchers[row], i) for i, row in enumerate(rows)])
        apply_token_bitmask_(logits, bitmask, vocab_size,
                             rows=None if len(rows) == len(matchers) else rows)
        return logits
