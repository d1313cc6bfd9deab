"""How a step's sampling rows become tokens, three ways: every row plain greedy (the model gave the
argmax tokens already, nothing else to read); a chooser (`EngineCore.step(choose=...)`, beam
search's hook) picking each row's tokens from the logits; or the sampler, with each prompt's first
sample fanned out to its n outputs. The rows of constrained sequences are masked by their grammars
first (pagedllm.structured), before a chooser or the sampler reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.engine.request_group import Choice, CoreSequence, fan_out, gather
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.worker.sampler import Sampler

# (logits [rows, vocab], (request id, sequence index) of each row) -> the tokens of each row: the
# first continues the sequence, each further one forks a new sequence off it (numbered after
# the request's last), and none ends the sequence (finished as aborted, with no output).
Chooser = Callable[[torch.Tensor, list[tuple[str, int]]], list[list[int]]]


def choose_tokens(seqs: list[CoreSequence], logits: torch.Tensor, argmax_only: bool,
                  choose: Chooser | None, sampler: Sampler,
                  structured: StructuredOutputManager) -> list[Choice]:
    """Each sequence's Choice from its row of logits (argmax_only: the rows are its tokens)."""
    if not seqs:
        return []
    if argmax_only:
        return [([token], [None]) for token in logits.tolist()]
    logits = structured.mask_logits(logits, [s.matcher for s in seqs])
    if choose is not None:
        picked = choose(logits, [(s.group.request_id, s.index) for s in seqs])
        if len(picked) != len(seqs):
            raise ValueError(f"the chooser gave {len(picked)} choices for {len(seqs)} rows")
        return [(tokens, [None] * len(tokens)) for tokens in picked]
    rows, row_of = fan_out(seqs)
    if len(rows) != len(seqs):  # a fan-out repeats its row; otherwise keep the view
        logits = logits.index_select(0, torch.tensor(row_of, device=logits.device))
    sampled = sampler(logits, rows)
    return gather(len(seqs), row_of, sampled.token_ids, sampled.logprobs)
