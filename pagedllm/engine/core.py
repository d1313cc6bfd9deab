"""The engine core: the loop. Each step is schedule -> execute -> sample -> update, over one map of
requests (pagedllm.engine.core_requests: every sequence, by the scheduler's request id).

EngineCoreRequests in (checked and tokenized by the input processor); out of each step,
EngineCoreOutputs: each sequence's new tokens, their logprobs, finish reasons, and the core's
figures (pagedllm.engine.messages). No tokenizer, no HTTP: the core can run in a process of its
own behind a channel. What it steps is loaded and planned first (pagedllm.engine.core_loader, with
the start-up line: EngineCore.facts). Each part's own:
- execute: the executor (pagedllm.worker.executor) runs the batch; prompt logprobs come back with
  its output (their requests read nothing from the prefix cache: the scheduler's rule).
- sample: pagedllm.engine.token_choice (argmax, a chooser such as beam search, or the sampler;
  rows masked by their grammars first).
- a failed step: the requests that fail the model alone end, the others run again without them
  (pagedllm.engine.step_isolation).
- a decode burst: a few greedy streams, nothing waiting, decode several tokens in one step, one
  model step each (pagedllm.engine.decode_burst).
- update: a sequence's Choice continues it, forks children (RequestGroup.branch, sharing the
  prompt's blocks) or ends it; a grammar that completes or refuses a token finishes it. A request
  whose grammar still compiles waits outside the scheduler until it is ready.
A pooling engine's step samples nothing: its requests get vectors (pagedllm.engine.pooling_step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import partial

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.core_loader import CoreParts, load_core_parts
from pagedllm.engine.core_requests import CoreRequests
from pagedllm.engine.decode_burst import burst_fits, plan_burst
from pagedllm.engine.lora_admission import LoRAAdmission
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreStats
from pagedllm.engine.pooling_step import check_pooling_request, run_pooling_step
from pagedllm.engine.request_group import Choice, CoreSequence, RequestGroup
from pagedllm.engine.speculation import Run
from pagedllm.engine.step_isolation import StepError, StepIsolation
from pagedllm.engine.token_choice import Chooser, choose_tokens
from pagedllm.lora.request import LoRARequest
from pagedllm.model.loader import LoadedModel
from pagedllm.sampling_bounds import check_runnable
from pagedllm.spec_decode.ngram import NgramBurst

__all__ = ["EngineCore", "StepError"]
logger = logging.getLogger(__name__)
ABORTED = RequestStatus.FINISHED_ABORTED
_GRAMMAR_WAIT_S = 0.005  # a core with only compiling grammars to wait for sleeps this between looks


class EngineCore(StepIsolation):
    def __init__(self, parts: CoreParts) -> None:
        self.scheduler, self.executor, self.sampler = parts.scheduler, parts.executor, parts.sampler
        self.structured, self.grammar_compiler = parts.structured, parts.grammar_compiler
        self.facts, self.kv_manager = parts.facts, parts.scheduler.kv_manager
        self.device, self.dtype, self.kv_plan = parts.facts.device, parts.facts.dtype, parts.facts.kv_plan
        self.speculator = parts.speculator  # None: no speculative decoding
        self.decode_burst = parts.decode_burst  # decode steps a burst runs (pagedllm.engine.decode_burst)
        self.requests = CoreRequests()
        self.lora = LoRAAdmission(parts.lora, self.requests)
        self._counts = dict(prompt=0, generation=0, computed=0, step_requests=0, step_blocks=0)

    @classmethod
    def load(cls, config: EngineConfig) -> tuple[EngineCore, LoadedModel]:
        """The core over config's model (pagedllm.engine.core_loader), and what the loader read."""
        parts, loaded = load_core_parts(config)
        return cls(parts), loaded

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (nothing kept) if its id is in use or it cannot fit."""
        if request.request_id in self.requests.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if "#" in request.request_id:  # "<id>#<i>" names a request's forks (RequestGroup)
            raise ValueError(f"request_id {request.request_id!r}: '#' is kept for forks' ids")
        # it may come decoded
        check_runnable(request.sampling_params, self.facts.vocab_size or None, self.facts.max_logprobs)
        check_pooling_request(request, self.facts.pooling is not None)
        (first,) = RequestGroup.start(request, self.device).seqs
        has_lora_slot = self.lora.assign(request, first)  # else it waits for one
        spec = request.sampling_params.structured_outputs
        self.scheduler.check_admissible(first.request)
        first.matcher = None if spec is None else self.structured.start(request.request_id, spec)
        if not has_lora_slot:
            self.lora.wait(first)
        elif spec is None or first.matcher is not None:  # else: when its grammar is compiled
            self.scheduler.add_request(first.request)
        self.requests.add(first)
        self._counts["prompt"] += len(request.prompt_token_ids)

    def load_lora(self, lora: LoRARequest) -> None:
        """Read and check a LoRA adapter now, kept read for its requests; ValueError (one line
        naming it) if it cannot be served."""
        self.lora.read(lora)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests (all their sequences) in any state; their blocks go back at once.
        Unknown or finished ids are skipped."""
        for request_id in request_ids:
            group = self.requests.group(request_id)
            if group is not None:
                self.structured.forget(request_id)
                self.scheduler.finish_requests(
                    [s.request.request_id for s in group.seqs if not s.request.is_finished], ABORTED)
                self.requests.forget(group)
                for seq in group.seqs:
                    self._forget_speculation(seq.request.request_id)

    def abort_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """End single sequences, given as (request id, index): one output of an n > 1 request
        that a stop string finished, say. Unknown or finished ones are skipped."""
        for request_id, index in sequences:
            group = self.requests.group(request_id)
            if group is not None and 0 <= index < len(group.seqs):
                if self.scheduler.finish_requests(group.seqs[index].request.request_id, ABORTED):
                    self.requests.retire(group.seqs[index])
                    self._forget_speculation(group.seqs[index].request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return self.requests.request_ids()

    # -- the step ------------------------------------------------------------------------------
    def step(self, choose: Chooser | None = None) -> EngineCoreOutputs:
        """One batch: schedule, execute, sample (or let `choose` pick), update.

        Raises StepError if running the batch failed: its requests are aborted by then and the
        core goes on. Anything else raised leaves the core in an unknown state."""
        refused = self.requests.admit_compiled_grammars(self.structured, self.scheduler)
        if self.lora.waiting:
            refused += self._admit_lora_waiting()
        running = self.scheduler.running
        ngram = None  # a burst's n-gram speculation, where it has one
        burst = (choose is None and self._bursts_now()
                 and burst_fits(self.decode_burst, running, self.requests.seqs))
        if burst:
            ngram = self.speculator.burst(running) if self.speculator is not None else None
            plan_burst(self.decode_burst, running, self.kv_plan.max_model_len, ngram.ks if ngram else None)
        elif self.speculator is not None and choose is None:
            self.speculator.propose(running, self.requests.seqs)
        out = self.scheduler.schedule()
        if self.speculator is not None:  # a draft model proposes into the slots just given
            self.speculator.fill(out, self.requests.seqs)
        counts = self._counts
        counts.update(step_requests=len(out.scheduled), step_blocks=self.kv_manager.stats().num_used_blocks,
                      computed=counts["computed"] + out.num_batched_tokens)
        started = time.perf_counter()
        try:
            outputs = self._run_burst(out, ngram) if burst else self._run(out, choose)
            failed, failure = [], ""
            if not burst:  # a burst's tokens ran as several steps: not one step's cost
                # What the step cost sizes the next steps' token share (pagedllm.core.step_cost).
                self.scheduler.step_cost.observe(out.num_batched_tokens, time.perf_counter() - started)
        except Exception as exc:
            run = partial(self._run_burst, ngram=ngram) if burst else partial(self._run, choose=choose)
            outputs, failed, failure = self._run_without_culprits(out, run, exc)
        if not out.scheduled:
            self.structured.wait(_GRAMMAR_WAIT_S)  # at once unless grammars compile
        return EngineCoreOutputs(refused + outputs, self.stats(), failed, failure)

    def _admit_lora_waiting(self) -> list[EngineCoreOutput]:
        admitted, refused = self.lora.admit_waiting()
        for first in admitted:
            if first.group.request.sampling_params.structured_outputs is None or first.matcher is not None:
                self.scheduler.add_request(first.request)
        return refused

    def _run(self, out: SchedulerOutput, choose: Chooser | None) -> list[EngineCoreOutput]:
        if self.facts.pooling is not None:  # vectors, not tokens
            return run_pooling_step(out, self.scheduler, self.executor, self.requests)
        seqs_by_id = self.requests.seqs
        sampling = [seqs_by_id[s.request.request_id] for s in out.scheduled if s.samples]
        argmax_only = choose is None and all(seq.takes_argmax for seq in sampling)
        wanted = self.requests.prompt_logprobs_wanted(s.request.request_id for s in out.scheduled)
        result = self.executor.execute(out, argmax_only, wanted)
        self.requests.record_prompt_logprobs(result.prompt_logprobs)
        if not out.scheduled:
            return []
        seqs = [seqs_by_id[out.scheduled[i].request.request_id] for i in result.sample_indices]
        counts = [1 + out.scheduled[i].num_spec_tokens for i in result.sample_indices]
        if len(counts) == len(result.logits):  # no speculating sequence this step
            choices = choose_tokens(seqs, result.logits, argmax_only, choose, self.sampler, self.structured)
            return self._update(out, seqs, choices)
        plain, speculating = self._split_rows(seqs, counts, result.logits)
        choices = choose_tokens(*plain, argmax_only, choose, self.sampler, self.structured)
        spec_seqs, spec_counts, spec_logits = speculating
        runs = self.speculator.verify(spec_seqs, spec_counts, spec_logits, argmax_only)
        return self._update(out, plain[0], choices, list(zip(spec_seqs, spec_counts, runs)))

    def _bursts_now(self) -> bool:
        """Whether this core may run a decode burst now (pagedllm.engine.decode_burst): on, and
        nothing waits to be scheduled or read."""
        return (self.decode_burst > 1 and self.facts.pooling is None and self.executor.runs_bursts
                and (self.speculator is None
                     or (self.speculator.proposes_in_bursts and self.executor.speculates_in_bursts))
                and not self.scheduler.num_waiting
                and not self.structured.num_compiling and not self.lora.waiting
                and not self.requests.num_collecting)

    def _run_burst(self, out: SchedulerOutput, ngram: NgramBurst | None) -> list[EngineCoreOutput]:
        """A decode burst's step: each sequence's tokens taken as an accepted speculative run;
        with n-gram speculation in its steps (ngram), their proposals counted as a speculative
        step's are."""
        for s in out.scheduled:  # plan_burst's: decodes only, with their placeholders
            if s.num_new_tokens != 1 + s.num_spec_tokens or s.num_computed_tokens != s.request.num_tokens - 1:
                raise RuntimeError(f"decode burst: {s.request.request_id} is not a decode")
        made, indices = self.executor.execute_burst(out, ngram, self.decode_burst if ngram else 0)
        seqs_by_id = self.requests.seqs
        for row, proposed, kept in made.steps:
            self.speculator.observe_step(out.scheduled[indices[row]].request.request_id, proposed, kept)
        runs = []
        for i, run in zip(indices, made.tokens, strict=True):
            s = out.scheduled[i]
            runs.append((seqs_by_id[s.request.request_id], 1 + s.num_spec_tokens, (run, [None] * len(run))))
        outputs = self._update(out, [], [], runs, observed=True)
        for request in self.scheduler.running:  # one the schedule left out keeps no placeholders
            request.spec_token_ids.clear()
        return outputs

    @staticmethod
    def _split_rows(seqs: list[CoreSequence], counts: list[int], logits: torch.Tensor):
        """(sequences, rows) of those that sample one row, and (sequences, row counts, rows) of
        those that verify a proposal."""
        plain, spec, plain_rows, spec_rows, spec_counts = [], [], [], [], []
        row = 0
        for seq, n in zip(seqs, counts):
            if n == 1:
                plain.append(seq)
                plain_rows.append(row)
            else:
                spec.append(seq)
                spec_counts.append(n)
                spec_rows.extend(range(row, row + n))
            row += n

        def rows(index: list[int]) -> torch.Tensor:
            return logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device))

        return (plain, rows(plain_rows)), (spec, spec_counts, rows(spec_rows))

    def _update(self, out: SchedulerOutput, seqs: list[CoreSequence], choices: list[Choice],
                runs: list[tuple[CoreSequence, int, Run]] = (),
                observed: bool = False) -> list[EngineCoreOutput]:
        """runs: each speculating sequence, the rows it verified (k + 1), and its run (observed:
        the speculator has counted the runs' proposals already, a burst's)."""
        dropped = [s.request.request_id for s, (tokens, _) in zip(seqs, choices) if not tokens]
        finished = self.scheduler.finish_requests(dropped, ABORTED) if dropped else []
        sampled: dict[str, int | list[int]] = {
            s.request.request_id: tokens[0] for s, (tokens, _) in zip(seqs, choices) if tokens}
        before = [seq.request.num_tokens for seq, _, _ in runs]
        sampled.update((seq.request.request_id, tokens) for seq, _, (tokens, _) in runs)
        finished += self.scheduler.update_from_output(out, sampled)
        outputs: dict[str, EngineCoreOutput] = {}
        for (seq, num_rows, run), num_tokens in zip(runs, before):
            if self.speculator is not None and not observed:
                self.speculator.observe(seq.request.request_id, num_rows - 1, len(run[0]) - 1)
            finished += self._take_run(seq, run, num_tokens, outputs)
        for seq, (tokens, logprobs) in zip(seqs, choices):
            if not tokens:
                continue
            self._counts["generation"] += len(tokens)
            # The children's grammars fork off seq's state before seq's matcher takes tokens[0].
            children = seq.group.branch(seq, tokens) if len(tokens) > 1 else ()
            if seq.matcher is not None:
                finished += self._finish(seq.request, seq.advance_grammar(tokens[0]))
            outputs[seq.request.request_id] = output = seq.output(tokens[:1], logprobs[:1])
            if self.requests.num_collecting:
                output.prompt_logprobs = self.requests.take_prompt_logprobs(seq)
            for child, token, lp in zip(children, tokens[1:], logprobs[1:]):
                finished += self._start_child(seq, child, token)
                outputs[child.request.request_id] = child.output([token], [lp])
        for request in finished:
            if (output := outputs.get(request.request_id)) is not None:
                output.finish_reason, output.stop_reason = request.status.value, request.stop_reason
                output.num_preemptions = request.num_preemptions
            self.requests.retire(self.requests.seqs[request.request_id])
            self._forget_speculation(request.request_id)
        return list(outputs.values())

    def _take_run(self, seq: CoreSequence, run: Run, num_tokens: int,
                  outputs: dict[str, EngineCoreOutput]) -> list[Request]:
        """A speculating sequence's output: the tokens of its run the scheduler kept (up to a
        stop; it appended them after num_tokens), its grammar advanced by each (a completed
        grammar ends it there)."""
        _, logprobs = run
        kept = seq.request.token_ids[num_tokens:]
        finished: list[Request] = []
        for i, token in enumerate(kept):
            finished = self._finish(seq.request, seq.advance_grammar(token))
            if finished:
                kept = kept[:i + 1]
                break
        self._counts["generation"] += len(kept)
        outputs[seq.request.request_id] = seq.output(kept, logprobs[:len(kept)])
        return finished

    def _start_child(self, parent: CoreSequence, child: CoreSequence, token: int) -> list[Request]:
        """Schedule a forked sequence: sharing parent's blocks, or recomputing the prompt where
        parent finished and gave them back; finished at once where token ends it."""
        if parent.request.status is RequestStatus.RUNNING:
            self.scheduler.fork_request(parent.request, child.request)
        else:
            self.scheduler.add_request(child.request)
        self.requests.add(child)
        finished = self._finish(child.request, self.scheduler.stop_status(child.request, token))
        return finished + self._finish(child.request, child.advance_grammar(token))

    def _forget_speculation(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _finish(self, request: Request, status: RequestStatus | None) -> list[Request]:
        return self.scheduler.finish_requests(request.request_id, status) if status else []

    # -- figures ------------------------------------------------------------------------------
    def block_map(self) -> BlockMap:
        """Every KV block's state, ref count, fill and owners (the dashboard's picture)."""
        return self.kv_manager.block_map()

    def stats(self) -> EngineCoreStats:
        counts = self._counts
        return EngineCoreStats(
            kv=self.kv_manager.stats(), num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.structured.num_compiling + self.lora.num_waiting,
            num_preemptions=self.scheduler.num_preemptions, num_prompt_tokens=counts["prompt"],
            num_generation_tokens=counts["generation"], num_computed_tokens=counts["computed"],
            kv_cache_dtype=self.facts.kv_cache_dtype, step_num_requests=counts["step_requests"],
            step_num_used_blocks=counts["step_blocks"],
            spec_decode=None if self.speculator is None else self.speculator.stats.copy(),
            step_share_tokens=self.scheduler.step_cost.share_tokens(),
            draft_kv_bytes_per_block=self.facts.draft_kv_bytes_per_block)
