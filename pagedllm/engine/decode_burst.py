"""Decode bursts: a few greedy streams decode several tokens per engine step, each token still
its own decode step of the model, but one schedule, one input preparation and one update of the
requests for all of them (vLLM V0's multi-step scheduling, for the CPU).

Why: a one-stream decode step of a small model spends a fifth of its time in the step's Python
(the scheduler, the batch's inputs, the outputs), which the weights' stream pushes out of cache
every token. A burst of B steps pays it once.

How: before the schedule, plan_burst gives each running sequence B - 1 placeholder proposals (as
a draft model's are, pagedllm.engine.speculation), so the scheduler gives them slots; the runner
runs the step as B decode steps, each step's argmax the next one's input (ModelRunner.run_burst);
the tokens come back as an accepted speculative run, so stops inside it, max_tokens, the KV trim
after a stop and the outputs are the speculative path's. The tokens are those of B plain decode
steps: the same kernels over the same rows. Where the model's steps run in one compiled call
(model/decode_layers.py), the whole burst is one call too (DecodeLayers.burst), so not even the
model's Python runs between its steps.

With n-gram speculation on, a burst's steps speculate: the compiled call proposes by the n-gram
rule before each of its B steps and verifies the proposal in the step (csrc/decode_burst.cpp), so
a step makes up to 1 + k tokens; each sequence gets B * (1 + k) - 1 placeholders, k as a plain
speculative step would choose it (Speculator.burst), and gives back the slots its steps did not
fill, as a rejected proposal does. The proposals are counted as speculative steps' are. Where the
call cannot run (the loop in Python), the burst makes its B tokens without proposals.

When (all of it, else a plain step): --decode-burst above 1; no speculative decoding, or the
n-gram rule; at most BURST_MAX_SEQS sequences running, nothing waiting (a newcomer waits at most
one burst); each running sequence decoding next, its token the argmax alone (greedy, no logprobs,
penalties or grammar: CoreSequence.takes_argmax); the runner one CPU process
(ModelRunner.runs_bursts). A burst never runs a sequence past max_tokens or max_model_len.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.request_group import CoreSequence
from pagedllm.spec_decode.draft import PLACEHOLDER_TOKEN

# Above this many running sequences a step's Python is shared by them already.
BURST_MAX_SEQS = 4


def burst_fits(length: int, running: Sequence[Request], seqs: Mapping[str, CoreSequence]) -> bool:
    """Whether this step may be a burst of `length` decode steps over the running sequences."""
    if length < 2 or not 1 <= len(running) <= BURST_MAX_SEQS:
        return False
    for request in running:
        seq = seqs.get(request.request_id)
        if (seq is None or request.status is not RequestStatus.RUNNING
                or request.num_computed_tokens != request.num_tokens - 1 or not seq.takes_argmax):
            return False
    return True


def plan_burst(length: int, running: Sequence[Request], max_model_len: int,
               ks: Mapping[str, int] | None = None) -> None:
    """Give each running sequence of a burst (burst_fits) its placeholder proposals: as many as
    its steps may make tokens (one each, or 1 + ks[request id] with n-gram speculation in them),
    fewer near its max_tokens or max_model_len."""
    for request in running:
        params = request.sampling_params
        per_step = 1 + (ks[request.request_id] if ks is not None else 0)
        k = min(length * per_step - 1, max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        request.spec_token_ids = [PLACEHOLDER_TOKEN] * max(k, 0)
