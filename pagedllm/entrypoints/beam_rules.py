"""Beam search's rules, shared by the offline search (pagedllm.entrypoints.beam_search) and the
server's (pagedllm.server.beam_search): which candidates go on, how a finished hypothesis scores,
which are kept. Plain Python: the API process imports this and must not import torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty
    text: str = ""
    finish_reason: str = "length"


Candidate = tuple[float, int, int]  # (cumulative logprob, token, the beam (row) it extends)


def select_candidates(ranked: list[Candidate], width: int,
                      eos_ids: tuple[int, ...]) -> tuple[list[Candidate], list[Candidate]]:
    """Of one prompt's candidates, best first: the `width` best that go on as beams, and those
    ending in an EOS id ranked above the last of them (finished hypotheses)."""
    going_on: list[Candidate] = []
    ending: list[Candidate] = []
    for candidate in ranked:
        if len(going_on) == width:
            break
        (ending if candidate[1] in eos_ids else going_on).append(candidate)
    return going_on, ending


def beam_score(cum_logprob: float, num_tokens: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty (Hugging Face's and vLLM's)."""
    return cum_logprob / max(num_tokens, 1) ** length_penalty


def best_sequences(finished: list[BeamSequence], width: int) -> list[BeamSequence]:
    return sorted(finished, key=lambda s: -s.score)[:width]
