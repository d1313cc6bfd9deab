"""Speculative decoding: several tokens per step for a sequence whose next tokens a cheap proposer
can guess, with exactly the target model's outputs (greedy) or output distribution (sampled).

On a CPU at the concurrency people serve (1-16 streams) a decode step is bound by memory: it reads
every weight and every cached key to make one token per sequence, so verifying k proposed tokens
costs little more than making one. Work that echoes its input (editing, refactoring, extraction,
JSON that repeats field names, quoting answers) lets a proposer guess most tokens.

The pieces, each usable and tested alone:

- config.SpeculativeConfig: vLLM's `speculative_config` (ngram, suffix, draft_model), validated
  in one place; check_draft_vocabulary refuses a draft with another vocabulary at start.
- ngram.NgramProposer, suffix.SuffixProposer: proposers over plain ints (proposer.Proposer);
  draft.DraftModelProposer: a draft model, its K/V in the target's blocks, which runs after the
  schedule (below).
- rejection.RejectionSampler, accept_greedy: which proposed tokens stand, and the token after.
- grammar.constrain_proposal: a constrained sequence's proposal cut at the first token its
  grammar refuses, with the mask of each position to verify.
- metrics.SpecDecodeStats (vLLM's counters), AcceptanceRate and choose_k (how many to propose).
- KVCacheManager.trim (pagedllm.core.kv.manager): rejected tokens' slots go back.

How they fit the step (pagedllm.engine.speculation runs this in the engine core):

1. Proposals, after each step's update (engine core, between update_from_output and the next
   schedule): for each running sequence whose next step is a decode, k = choose_k(its
   AcceptanceRate, the number of running sequences, num_speculative_tokens), capped so that the
   sequence cannot pass max_tokens or max_model_len (k <= max_tokens - num_output_tokens - 1 and
   num_tokens + k < max_model_len: the step emits at most k + 1 tokens); the proposer fills
   request.spec_token_ids (n-gram and suffix in the core process, on token ids it already has;
   a draft model with k placeholders, replaced by its tokens once the scheduler has given them
   slots, in which it writes its K/V first: pagedllm.spec_decode.draft). A structured-output
   sequence's proposal is cut at the first token its grammar refuses (grammar.constrain_proposal,
   which also gives each position's mask).
2. Scheduling: a speculating request asks for num_tokens + len(spec_token_ids) -
   num_computed_tokens new tokens (1 + k for a decode) out of the token budget, and
   allocate_slots(request, 1 + k) takes slots for them like any tokens (copy-on-write first for
   a shared block). Short of budget or blocks, the scheduler drops proposals (all or the tail)
   before it preempts anyone: speculation is optional, a preemption is not free.
3. The runner runs the k + 1 positions as one sequence of the flat batch (as it does a prefill
   chunk: positions num_computed_tokens .. + k, input ids the last accepted token then the
   proposal) and returns logits for every one of those positions (sample rows: k + 1 for a
   speculating sequence, one otherwise); with argmax_only (every row greedy, nothing else read),
   their argmax ids, which accept_greedy takes directly.
4. Verification in the engine core, where sampling is now: grammar masks per position (from
   step 1's constrain_proposal), then RejectionSampler (the sampler's own logits
   processing and sampling distribution, per position with the history grown by the proposed
   tokens before it), giving each sequence its accepted tokens and one more.
5. Update: num_computed_tokens += 1 + accepted (only accepted K/V counts as computed, so the
   prefix cache hashes and registers only blocks of accepted tokens); the tokens are appended
   one by one with the ordinary stop checks after each (EOS, stop ids, min_tokens' bans already in
   p, max_tokens, max_model_len), the tokens after a stop dropped; then
   KVCacheManager.trim(request, num_computed_tokens) gives back the rejected slots (a finished
   request frees everything anyway), and the runner's block table rewrites the row from the cut
   (SchedulerOutput.trimmed: another request may take a given-back block before this one grows
   again). spec_token_ids is emptied; the stats and the sequence's AcceptanceRate observe
   (proposed, accepted).
6. Outputs: an EngineCoreOutput already carries a list of new token ids; a speculating sequence's
   carries up to k + 1, with their logprobs. The output processor detokenizes them in order and
   checks stop strings after each (text past a stop string is cut, as now), so a stream gets
   several tokens in one delta.

Inside decode bursts (pagedllm.engine.decode_burst: up to 4 greedy streams of a model whose
decode steps run in one compiled call), steps 1-5 of the n-gram rule run in C++ for each of the
burst's steps (csrc/decode_burst.cpp, the same lookup and greedy acceptance), the engine seeing
one step whose tokens are the burst's and whose steps the stats observe one by one.

What composes: preemption drops spec_token_ids with the blocks (recompute needs none); prefix
caching sees only accepted tokens (above); n > 1 and beam search fork between steps, when no
proposal is pending, and a child's first write into a shared block copies it as now; a sliding
window frees blocks before the window as now (trim only touches the tail); greedy outputs equal
the plain run's (with --batch-invariant in bf16, as the verification batch differs in shape).
"""

from __future__ import annotations

from pagedllm.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, check_draft_vocabulary
from pagedllm.spec_decode.metrics import AcceptanceRate, SpecDecodeStats, choose_k
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import Proposer, SequenceTokens
from pagedllm.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a model-free method (n-gram, suffix). A draft model needs the engine's
    model loaded and the target's blocks: the engine's loader builds its DraftModelProposer."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    raise ValueError(f"method {config.method!r} proposes with a model: the engine builds its proposer")


__all__ = ["MAX_SPECULATIVE_TOKENS", "AcceptanceRate", "NgramProposer", "Proposer", "SequenceTokens",
           "SpecDecodeStats", "SpeculativeConfig", "SuffixProposer", "check_draft_vocabulary",
           "choose_k", "make_proposer"]
