"""Beam search over the paged cache: beams of one prompt share their common history's blocks.

Every step each live beam yields its 2W best next tokens; of all candidates of a prompt the W
best (by cumulative log-probability) live on. A beam chosen k times continues itself and forks
k - 1 children that share all its blocks by reference count; the first write into a shared
partial block is copied (copy-on-write). A beam not chosen is finished at once, so blocks only
it held go straight back to the pool. A candidate ending in EOS becomes a finished hypothesis.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float
    score: float  # cum_logprob / len ** length_penalty
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first
    peak_blocks_used: int = 0


@dataclass
class _Beam:
    request: Request
    cum_logprob: float = 0.0
    candidates: list[tuple[float, int]] = field(default_factory=list)  # (cum logprob, token)


@dataclass
class _Prompt:
    token_ids: list[int]
    beams: list[_Beam]
    finished: list[BeamSequence] = field(default_factory=list)


class BeamSearch:
    def __init__(self, engine, beam_width: int, max_tokens: int, length_penalty: float = 1.0) -> None:
        if not isinstance(beam_width, int) or beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer; got {beam_width!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer; got {max_tokens!r}")
        if engine.has_unfinished_requests():
            raise ValueError("beam search needs an idle engine: finish or abort other requests first")
        self.engine = engine
        self.scheduler = engine.scheduler
        self.width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.eos = engine.tokenizer.eos_token_id
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
        cfg = self.scheduler.config
        bs = self.engine.block_size
        capacity_blocks = self.engine.num_blocks
        waves, current, used = [], [], 0
        for ids in prompts:
            if len(ids) + self.max_tokens >= cfg.max_model_len:
                raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {self.max_tokens} must stay "
                                 f"below max_model_len={cfg.max_model_len}")
            need = self.width * -(-(len(ids) + self.max_tokens) // bs)
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
        # Beams stop themselves (EOS, max_tokens); the scheduler must never do it for them.
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens + 1, ignore_eos=True)
        states = []
        for ids in prompts:
            root = Request(f"beam-{next(self._ids)}", list(ids), params, eos_token_id=self.eos)
            self.scheduler.add_request(root)
            states.append(_Prompt(list(ids), [_Beam(root)]))
        try:
            while any(p.beams for p in states):
                self._step(states)
        finally:
            for p in states:
                self._drop([b.request for b in p.beams])
        return [self._output(p) for p in states]

    def _step(self, states: list[_Prompt]) -> None:
        out = self.scheduler.schedule()
        self.engine.runner.drop_requests(out.finished + out.preempted)
        if out.preempted:
            raise RuntimeError("beam search preempted a beam despite the capacity check")
        stats = self.scheduler.kv_manager.stats()
        self.peak_blocks_used = max(self.peak_blocks_used, stats.num_blocks - stats.num_free_blocks)
        self.engine.runner.copy_blocks(out.block_copies)
        logits, sample_idx = self.engine.runner.execute(out.scheduled)
        sampled = [out.scheduled[i].request for i in sample_idx]
        if not sampled:
            return
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_values, top_ids = logprobs.topk(min(2 * self.width, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()  # to the host once
        by_request = {r.request_id: j for j, r in enumerate(sampled)}
        # Provisional token (the beam's best) so the scheduler can account the step; the
        # selection below may replace it: it is not computed into the cache until next step.
        provisional = {r.request_id: top_ids[j][0] for j, r in enumerate(sampled)}
        self.scheduler.update_from_output(out, provisional)
        for p in states:
            ready = [b for b in p.beams if b.request.request_id in by_request]
            if not ready:
                continue
            if len(ready) != len(p.beams):
                raise RuntimeError("beams of one prompt fell out of step")
            for b in ready:
                j = by_request[b.request.request_id]
                b.candidates = [(b.cum_logprob + v, t)
                                for v, t in zip(top_values[j], top_ids[j])]
            self._select(p)

    def _select(self, p: _Prompt) -> None:
        ranked = sorted(((cum, token, beam) for beam in p.beams for cum, token in beam.candidates),
                        key=lambda c: -c[0])
        chosen: dict[int, list[tuple[float, int]]] = {id(b): [] for b in p.beams}
        alive = 0
        for cum, token, beam in ranked:
            if alive == self.width:
                break
            outputs = beam.request.output_token_ids[:-1]  # without the provisional token
            if token == self.eos and self.eos is not None:
                p.finished.append(self._sequence(outputs + [token], cum, "stop"))
                continue
            chosen[id(beam)].append((cum, token))
            alive += 1
        new_beams = []
        for beam in p.beams:
            picks = chosen[id(beam)]
            if not picks:
                self._drop([beam.request])
                continue
            for cum, token in picks[1:]:
                new_beams.append(self._fork(beam, cum, token))
            beam.request.token_ids[-1] = picks[0][1]  # replace the provisional token
            beam.cum_logprob = picks[0][0]
            new_beams.append(beam)
        p.beams = []
        for beam in new_beams:
            if beam.request.num_output_tokens >= self.max_tokens:
                p.finished.append(self._sequence(beam.request.output_token_ids, beam.cum_logprob, "length"))
                self._drop([beam.request])
            else:
                p.beams.append(beam)

    def _fork(self, parent: _Beam, cum: float, token: int) -> _Beam:
        request = parent.request
        child = Request(f"beam-{next(self._ids)}", request.prompt_token_ids,
                        dataclasses.replace(request.sampling_params), eos_token_id=self.eos)
        child.token_ids = request.token_ids[:-1] + [token]
        self.scheduler.fork_request(request, child)
        return _Beam(child, cum)

    def _drop(self, requests: list[Request]) -> None:
        live = [r.request_id for r in requests if not r.is_finished]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def _sequence(self, token_ids: list[int], cum: float, reason: str) -> BeamSequence:
        length = max(len(token_ids), 1)
        return BeamSequence(list(token_ids), cum, cum / length ** self.length_penalty,
                            self.engine.tokenizer.decode(token_ids), reason)

    def _output(self, p: _Prompt) -> BeamSearchOutput:
        best = sorted(p.finished, key=lambda s: -s.score)[:self.width]
        return BeamSearchOutput(p.token_ids, best, self.peak_blocks_used)
