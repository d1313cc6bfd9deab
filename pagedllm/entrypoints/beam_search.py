"""Beam search over the paged cache: beams of one prompt share their common history's blocks.

It runs on the engine core's own step, choosing the tokens itself (EngineCore.step's `choose`
hook) instead of the sampler. Every step each live beam yields its 2W best next tokens; of all
candidates of a prompt the W best (by cumulative log-probability) live on. A beam chosen k times
continues itself and forks k - 1 new sequences that share all its blocks by reference count;
the first write into a shared partial block is copied (copy-on-write). A beam not chosen gets no
token, which ends it, so blocks only it held go straight back to the pool. A candidate ending in
an EOS id becomes a finished hypothesis; a beam reaching max_tokens is finished by the core.
With early_stopping, a prompt's search ends as soon as it has W finished hypotheses (Hugging
Face's and vLLM's early_stopping=True); without, its beams go on to max_tokens.

The rules that pick the beams are pagedllm.entrypoints.beam_rules (no torch), the server's too:
pagedllm/server/beam_search.py drives them through ordinary requests of the serving core.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.entrypoints.beam_rules import (
    BeamSequence,
    beam_score,
    best_sequences,
    select_candidates,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.text.tokenizer import Tokenizer
from pagedllm.utils import cdiv


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first
    peak_blocks_used: int = 0


@dataclass
class _Beam:
    token_ids: list[int]  # generated so far
    cum_logprob: float = 0.0


@dataclass
class _Prompt:
    request_id: str
    token_ids: list[int]
    beams: dict[int, _Beam]  # by the core's sequence index
    num_seqs: int = 1  # sequences the core has made for it: the next fork gets this index
    finished: list[BeamSequence] = field(default_factory=list)


def check_beam_args(beam_width, max_tokens) -> None:
    if not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive integer; got {beam_width!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer; got {max_tokens!r}")


class BeamSearch:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer, beam_width: int, max_tokens: int,
                 length_penalty: float = 1.0, early_stopping: bool = False) -> None:
        check_beam_args(beam_width, max_tokens)
        if core.has_unfinished_requests():
            raise ValueError("beam search needs an idle engine: finish or abort other requests first")
        self.core = core
        self.tokenizer = tokenizer
        self.width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self._ids = itertools.count()
        self.peak_blocks_used = 0

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        outputs = []
        for wave in self._waves(prompts):
            outputs.extend(self._run_wave(wave))
        return outputs

    # -- capacity: no preemption may split a prompt's beams ---------------------------------------
    def _waves(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Group prompts so each group's beams fit the cache and one step's budget together."""
        cfg = self.core.scheduler.config
        capacity_blocks = self.core.kv_plan.num_blocks
        waves, current, used = [], [], 0
        for ids in prompts:
            if len(ids) + self.max_tokens >= cfg.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {self.max_tokens} must stay "
                                 f"below max_model_len={cfg.max_model_len}")
            need = self.width * cdiv(len(ids) + self.max_tokens, self.core.kv_plan.block_size)
            if need > capacity_blocks:
                raise ValueError(f"beam width {self.width} over {len(ids) + self.max_tokens} tokens needs "
                                 f"{need} blocks; the cache has {capacity_blocks}: raise kv_cache_memory")
            fits_budget = (len(current) + 1) * self.width <= min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
            if current and (used + need > capacity_blocks or not fits_budget):
                waves.append(current)
                current, used = [], 0
            current.append(ids)
            used += need
        if current:
            waves.append(current)
        return waves

    # -- one wave ---------------------------------------------------------------------------------
    def _run_wave(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        # Beams end on EOS here, never in the core; the core ends them at max_tokens.
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)
        states: dict[str, _Prompt] = {}
        try:
            for ids in prompts:
                request_id = f"beam-{next(self._ids)}"
                self.core.add_request(EngineCoreRequest(request_id, list(ids), params, self.eos_ids,
                                                        time.monotonic()))
                states[request_id] = _Prompt(request_id, list(ids), {0: _Beam([])})
            while any(p.beams for p in states.values()):
                preemptions = self.core.stats().num_preemptions
                stats = self.core.step(choose=lambda logits, rows: self._choose(states, logits, rows)).stats
                if stats.num_preemptions != preemptions:
                    raise RuntimeError("beam search preempted a beam despite the capacity check")
                self.peak_blocks_used = max(self.peak_blocks_used, stats.step_num_used_blocks)
        finally:
            self.core.abort_requests(states)
        return [self._output(p) for p in states.values()]

    def _choose(self, states: dict[str, _Prompt], logits: torch.Tensor,
                rows: list[tuple[str, int]]) -> list[list[int]]:
        """Each row's tokens: the W best candidates of each prompt, over all its beams."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_values, top_ids = logprobs.topk(min(2 * self.width, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()  # to the host once
        choices: list[list[int]] = [[] for _ in rows]
        by_prompt: dict[str, list[int]] = {}
        for j, (request_id, _) in enumerate(rows):
            by_prompt.setdefault(request_id, []).append(j)
        for request_id, row_ids in by_prompt.items():
            p = states[request_id]
            if len(row_ids) != len(p.beams):
                raise RuntimeError("beams of one prompt fell out of step")
            candidates = [(p.beams[rows[j][1]].cum_logprob + v, t, j)
                          for j in row_ids for v, t in zip(top_values[j], top_ids[j])]
            self._select(p, sorted(candidates, key=lambda c: -c[0]), rows, choices)
        return choices

    def _select(self, p: _Prompt, ranked: list[tuple[float, int, int]], rows: list[tuple[str, int]],
                choices: list[list[int]]) -> None:
        """Keep the W best candidates as beams (row j's choices: the first continues its beam,
        the rest fork new ones); EOS candidates become finished hypotheses."""
        new_beams: dict[int, _Beam] = {}
        forks = []
        going_on, ending = select_candidates(ranked, self.width, self.eos_ids)
        for cum, token, j in ending:
            p.finished.append(self._sequence(p.beams[rows[j][1]].token_ids + [token], cum, "stop"))
        if self.early_stopping and len(p.finished) >= self.width:
            p.beams = {}  # no row of it gets a token: every beam ends
            return
        for cum, token, j in going_on:
            beam = p.beams[rows[j][1]]
            if choices[j]:
                forks.append((j, len(choices[j]), _Beam(beam.token_ids + [token], cum)))
            else:
                new_beams[rows[j][1]] = _Beam(beam.token_ids + [token], cum)
            choices[j].append(token)
        for _, _, beam in sorted(forks, key=lambda f: f[:2]):  # the core's order: by row, then token
            new_beams[p.num_seqs] = beam
            p.num_seqs += 1
        p.beams = {}
        for index, beam in new_beams.items():
            if len(beam.token_ids) >= self.max_tokens:  # the core ends it too (max_tokens)
                p.finished.append(self._sequence(beam.token_ids, beam.cum_logprob, "length"))
            else:
                p.beams[index] = beam

    def _sequence(self, token_ids: list[int], cum: float, reason: str) -> BeamSequence:
        return BeamSequence(list(token_ids), cum, beam_score(cum, len(token_ids), self.length_penalty),
                            self.tokenizer.decode(token_ids), reason)

    def _output(self, p: _Prompt) -> BeamSearchOutput:
        return BeamSearchOutput(p.token_ids, best_sequences(p.finished, self.width), self.peak_blocks_used)
