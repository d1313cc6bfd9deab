"""The engine core: owns the scheduler, the KV manager, the model runner and the sampler, and
steps them: schedule -> execute -> sample -> update. Nothing else.

Requests come in as EngineCoreRequests (checked and tokenized by the input processor); each
step answers with EngineCoreOutputs: for every sequence with news, its new token ids and their
log-probabilities, finish reasons, and the core's figures (pagedllm.engine.messages). Text, stop
strings and what a user sees are the output processor's. The core knows nothing about
tokenizers or HTTP, so it can run in its own process behind a channel carrying those messages.

Prompt logprobs (SamplingParams.prompt_logprobs) come from the hidden states of a prompt's own
chunks: each position's logits give the next prompt token's log-probability. A step computes
them only for the requests that ask, a slice of rows at a time, and the first output carries
them. Such requests read nothing from the prefix cache (the scheduler's rule): a cached token's
hidden state is not there to read.

Parallel sampling (n > 1) stays here, because its outputs share the prompt's KV blocks: the
first sample draws n tokens and forks the sequence (pagedllm.engine.request_group). `step(choose=...)`
lets a caller pick the tokens from the logits instead of the sampler, forking a sequence by
picking several; beam search runs on that hook.

Structured outputs (pagedllm.structured) live here too, because a grammar's state is a
sequence's: each constrained sequence has a matcher, forked with it (n > 1, beams), advanced with
every token it keeps, kept through preemption (recompute keeps the output tokens, so the state
stays right). The rows that sample are masked before the sampler or a chooser sees them, and a
sequence whose grammar is complete finishes ("stop") without waiting for an EOS that is the
only token left: with ignore_eos too, since nothing else could follow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from pagedllm.config import EngineConfig, SchedulerConfig, default_block_size
from pagedllm.core.kv.plan import KVPlan, describe_plan, make_kv_manager, plan_kv_cache
from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.device import resolve_device
from pagedllm.distributed.driver import load_engine_model
from pagedllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
    TokenLogprobs,
)
from pagedllm.engine.request_group import CoreSequence, RequestGroup
from pagedllm.kernels import compiled
from pagedllm.kernels.attention import kv_cache_bytes_per_block
from pagedllm.kernels.attention.kv_quant import stored_dtype_name
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import LoadedModel, resolve_dtype
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.utils import keep_freed_memory_for_reuse, release_freed_memory
from pagedllm.worker.runner import ModelRunner
from pagedllm.worker.sampler import Sampler, takes_argmax

logger = logging.getLogger(__name__)

# (logits [rows, vocab], (request id, sequence index) of each row) -> the tokens of each row: the
# first continues the sequence, each further one forks a new sequence off it (numbered after
# the request's last), and none ends the sequence (finished as aborted, with no output).
Chooser = Callable[[torch.Tensor, list[tuple[str, int]]], list[list[int]]]

# Prompt positions turned into logits at once for prompt logprobs: bounds the [rows, vocab] tensor.
PROMPT_LOGPROB_ROWS = 256


class StepError(RuntimeError):
    """A step failed. The requests it ran are finished (aborted, their blocks freed) already;
    request_ids names them. The cause is chained (raise ... from)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the engine step failed: {cause!r}")
        self.request_ids = request_ids


# How long a core with nothing to run but requests whose grammars compile sleeps between looks.
_GRAMMAR_WAIT_S = 0.005


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                 dtype: torch.dtype, grammar_compiler: GrammarCompiler | None = None) -> None:
        """grammar_compiler: for requests with structured_outputs (None: such requests are
        refused); in one process, the input processor's, so their compiles are shared."""
        self.device = next(model.parameters()).device  # where the loader put the weights
        if self.device.type == "cpu":
            compiled.available()  # build (or find) the kernels now, not in the first request
        self.dtype = dtype
        if config.block_size is None:  # the device's default, now that the device is known
            config.block_size = default_block_size(self.device.type)
        self.kv_layout = config.kv_layout
        self.choices = config.describe_choices()  # for the start-up line
        # Scales included: a byte budget buys proportionally more blocks of a compressed cache.
        # The heads are this process's (model.config): under tensor parallelism its share, the
        # largest of any rank's, so the budget is what each rank's cache may take.
        bytes_per_block = kv_cache_bytes_per_block(
            model_config.num_hidden_layers, config.block_size, model.config.num_key_value_heads,
            model_config.head_dim, dtype, config.kv_cache_dtype)
        self.kv_cache_dtype = stored_dtype_name(config.kv_cache_dtype, dtype)
        self.kv_plan: KVPlan = plan_kv_cache(
            config, bytes_per_block, model_config.max_position_embeddings,
            sliding_window=model_config.kv_window, free_device_bytes=_free_device_bytes(self.device))
        max_model_len = self.kv_plan.max_model_len
        self.kv_manager = make_kv_manager(config, self.kv_plan)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
            self.kv_manager)
        self.runner = ModelRunner(
            model, num_blocks=self.kv_plan.num_blocks, block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len, kv_dtype=dtype, device=self.device,
            kv_cache_dtype=config.kv_cache_dtype, batch_invariant=config.batch_invariant,
            enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs)
        self.sampler = Sampler(config.seed, self.device)
        self.grammar_compiler = grammar_compiler
        self.structured = StructuredOutputManager(grammar_compiler)
        self._groups: dict[str, RequestGroup] = {}
        # Requests held back until their grammar compiles (only a core that did not compile it
        # before, like one in a process of its own, ever waits), by request id.
        self._awaiting_grammar: dict[str, RequestGroup] = {}
        self._seqs: dict[str, CoreSequence] = {}  # by the scheduler's request id
        # Groups whose prompt logprobs are still being computed or not yet sent, by request id.
        self._collecting_prompt_logprobs: dict[str, RequestGroup] = {}
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_computed_tokens = 0
        self._step_num_requests = 0
        self._step_num_used_blocks = 0
        self.weight_bytes = model.weight_bytes()  # after the runner's prepacking
        release_freed_memory()  # what loading and prepacking the weights freed
        keep_freed_memory_for_reuse()  # from here on, what a step frees serves the next

    @classmethod
    def load(cls, config: EngineConfig) -> tuple[EngineCore, LoadedModel]:
        """The core over config's model, loaded on config's device; and what the loader read
        (the tokenizer among it, for whoever runs the core in its own process). The core gets a
        grammar compiler of its own (EngineCore.grammar_compiler: one process's input processor
        shares it)."""
        device = resolve_device(config.device)
        loaded = load_engine_model(config, device)
        core = cls(config, loaded.model, loaded.config, resolve_dtype(config.dtype, device),
                   GrammarCompiler(loaded.tokenizer))
        return core, loaded

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler.config

    def describe(self, weights_note: str) -> str:
        """The start-up line: every choice that changes which code runs. The KV cache's blocks,
        bytes and what fits; the weights' bytes and weights_note (LoadedModel.weights_note: what
        stayed quantized, what is float); the device and dtype; prefix caching, tensor
        parallelism, batch invariance."""
        return (f"{describe_plan(self.kv_plan, self.kv_cache_dtype, self.kv_layout)}; "
                f"weights {self.weight_bytes / 2**20:.1f} MiB ({weights_note}); "
                f"{self.device}, {str(self.dtype).removeprefix('torch.')}, {self.choices}")

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (nothing kept) if its id is in use or it cannot fit."""
        if request.request_id in self._groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        group = RequestGroup.start(request, self.device)
        (first,) = group.seqs
        spec = request.sampling_params.structured_outputs
        if spec is None:
            self.scheduler.add_request(first.request)
        else:
            self.scheduler.check_admissible(first.request)
            first.matcher = self.structured.start(request.request_id, spec)
            if first.matcher is None:
                self._awaiting_grammar[request.request_id] = group
            else:
                self.scheduler.add_request(first.request)
        self._groups[request.request_id] = group
        self._seqs[first.request.request_id] = first
        if group.prompt_logprobs is not None:
            self._collecting_prompt_logprobs[request.request_id] = group
        self._num_prompt_tokens += len(request.prompt_token_ids)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests (all their sequences) in any state; their blocks go back at once.
        Unknown or finished ids are skipped."""
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            self._collecting_prompt_logprobs.pop(request_id, None)
            if self._awaiting_grammar.pop(request_id, None) is not None:
                self.structured.forget(request_id)
            live = [s.request.request_id for s in group.seqs if not s.request.is_finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for seq in group.seqs:
                self._seqs.pop(seq.request.request_id, None)

    def abort_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """End single sequences, given as (request id, index): one output of an n > 1 request
        that a stop string finished, say. Unknown or finished ones are skipped."""
        for request_id, index in sequences:
            group = self._groups.get(request_id)
            if group is None or not 0 <= index < len(group.seqs):
                continue
            seq = group.seqs[index]
            if self.scheduler.finish_requests(seq.request.request_id, RequestStatus.FINISHED_ABORTED):
                self._retire(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self, choose: Chooser | None = None) -> EngineCoreOutputs:
        """One batch: schedule, run the model, sample (or let `choose` pick), update.

        Raises StepError if running the batch failed: its requests are aborted by then and the
        core goes on. Anything else raised leaves the core in an unknown state."""
        refused = self._admit_compiled_grammars()
        out = self.scheduler.schedule()
        self.runner.drop_requests(out.finished + out.preempted)
        self._step_num_requests = len(out.scheduled)
        self._step_num_used_blocks = self.kv_manager.stats().num_used_blocks
        self._num_computed_tokens += out.num_batched_tokens
        outputs: list[EngineCoreOutput] = []
        if out.scheduled:
            try:
                outputs = self._run(out, choose)
            except Exception as exc:
                raise StepError(self._fail(out), exc) from exc
        elif self._awaiting_grammar:
            self.structured.wait(_GRAMMAR_WAIT_S)
        return EngineCoreOutputs(refused + outputs, self.stats())

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Hand the scheduler the requests whose grammars are now compiled; end those whose
        grammars failed (an "abort" for each output, so the front end hears of it)."""
        refused: list[EngineCoreOutput] = []
        for request_id, result in self.structured.ready():
            group = self._awaiting_grammar.pop(request_id)
            (first,) = group.seqs
            if isinstance(result, GrammarMatcher):
                first.matcher = result
                self.scheduler.add_request(first.request)
                continue
            logger.error("request %s: its grammar did not compile: %s", request_id, result)
            del self._groups[request_id]
            self._seqs.pop(first.request.request_id, None)
            refused += [EngineCoreOutput(request_id, i, [], finish_reason="abort")
                        for i in range(group.request.sampling_params.n)]
        return refused

    def _run(self, out: SchedulerOutput, choose: Chooser | None) -> list[EngineCoreOutput]:
        self.runner.copy_blocks(out.block_copies)
        sampling = [self._seqs[s.request.request_id] for s in out.scheduled if s.samples]
        argmax_only = choose is None and all(map(_takes_argmax, sampling))
        logits, sample_idx, hidden = self.runner.execute(out.scheduled, argmax_only)
        if self._collecting_prompt_logprobs:
            self._add_prompt_logprobs(out, hidden)
        seqs = [self._seqs[out.scheduled[i].request.request_id] for i in sample_idx]
        if not seqs:  # prompt chunks only: nothing to sample, but the update counts them
            choices, logprobs = [], []
        elif argmax_only:  # every row greedy with nothing else to read: the model gave the tokens
            choices, logprobs = [[token] for token in logits.tolist()], [[None]] * len(seqs)
        else:
            logits = self.structured.mask_logits(logits, [s.matcher for s in seqs])
            choices, logprobs = (self._sample(logits, seqs) if choose is None
                                 else self._choose(choose, logits, seqs))
        return self._update(out, seqs, choices, logprobs)

    def _choose(self, choose: Chooser, logits: torch.Tensor, seqs: list[CoreSequence]):
        choices = choose(logits, [(s.group.request_id, s.index) for s in seqs])
        if len(choices) != len(seqs):
            raise ValueError(f"the chooser gave {len(choices)} choices for {len(seqs)} rows")
        return choices, [[None] * len(tokens) for tokens in choices]

    def _add_prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """The prompt logprobs this step's chunks give, for the groups that ask: position p's
        logits hold the log-probability of prompt token p + 1."""
        row = 0  # where each scheduled request's tokens start in the flat batch
        for s in out.scheduled:
            group = self._collecting_prompt_logprobs.get(s.request.request_id)
            first = s.num_computed_tokens
            count = min(s.num_new_tokens, s.request.num_prompt_tokens - 1 - first)
            if group is not None and count > 0:
                prompt = group.request.prompt_token_ids
                num_top = group.request.sampling_params.prompt_logprobs
                for a in range(0, count, PROMPT_LOGPROB_ROWS):
                    n = min(PROMPT_LOGPROB_ROWS, count - a)
                    logits = self.runner.compute_logits(hidden, row + a, row + a + n)
                    targets = prompt[first + a + 1:first + a + n + 1]
                    group.prompt_logprobs[first + a + 1:first + a + n + 1] = \
                        self.sampler.logprobs_of(logits, targets, num_top)
            row += s.num_new_tokens

    def _sample(self, logits: torch.Tensor, seqs: list[CoreSequence]):
        """One token per sequence; n from a prompt's first logits (its fan-out)."""
        rows, row_of = [], []  # row_of[r]: the sequence row r samples for
        for j, seq in enumerate(seqs):
            fan_out = seq.group.take_fan_out_rows(seq) if seq.group.fan_out > 1 else (seq.row,)
            rows.extend(fan_out)
            row_of.extend([j] * len(fan_out))
        if len(rows) != len(seqs):  # a fan-out repeats its row; otherwise keep the view
            logits = logits.index_select(0, torch.tensor(row_of, device=logits.device))
        result = self.sampler(logits, rows)
        choices: list[list[int]] = [[] for _ in seqs]
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in seqs]
        for j, token, lp in zip(row_of, result.token_ids, result.logprobs):
            choices[j].append(token)
            logprobs[j].append(lp)
        return choices, logprobs

    def _update(self, out: SchedulerOutput, seqs: list[CoreSequence], choices: list[list[int]],
                logprobs: list[list[TokenLogprobs | None]]) -> list[EngineCoreOutput]:
        dropped = [s.request.request_id for s, tokens in zip(seqs, choices) if not tokens]
        finished = self.scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED) if dropped else []
        finished += self.scheduler.update_from_output(
            out, {s.request.request_id: tokens[0] for s, tokens in zip(seqs, choices) if tokens})
        outputs: dict[str, EngineCoreOutput] = {}
        for seq, tokens, lps in zip(seqs, choices, logprobs):
            if not tokens:
                continue
            self._num_generation_tokens += len(tokens)
            # Children's grammars fork off the state the tokens were all drawn from.
            child_matchers = [seq.matcher and seq.matcher.fork() for _ in tokens[1:]]
            finished += self._advance_grammar(seq, tokens[0])
            outputs[seq.request.request_id] = output = _output(seq, tokens[0], lps[0])
            if seq.index == 0 and self._collecting_prompt_logprobs:  # the prompt is done: send them
                group = self._collecting_prompt_logprobs.pop(seq.group.request_id, None)
                output.prompt_logprobs = group.prompt_logprobs if group is not None else None
            for token, lp, matcher in zip(tokens[1:], lps[1:], child_matchers):
                child, child_finished = self._fork(seq, token, matcher)
                outputs[child.request.request_id] = _output(child, token, lp)
                finished += child_finished
        for request in finished:
            output = outputs.get(request.request_id)
            if output is not None:
                output.finish_reason = request.status.value
                output.stop_reason = request.stop_reason
                output.num_preemptions = request.num_preemptions
            self._retire(self._seqs[request.request_id])
        return list(outputs.values())

    def _advance_grammar(self, seq: CoreSequence, token: int) -> list[Request]:
        """Advance a constrained sequence's matcher by the token it kept. Its grammar complete:
        the sequence is finished ("stop"). The token refused (only a chooser can pick one, or
        logits that were all -inf): it ends ("abort"), as it cannot go on validly."""
        matcher = seq.matcher
        if matcher is None or seq.request.is_finished:
            return []
        if matcher.accept_token(token):
            if not matcher.is_terminated:
                return []
            status = RequestStatus.FINISHED_STOPPED
        else:
            logger.error("request %s: the grammar refused token %d (%s); ending the sequence",
                         seq.request.request_id, token, matcher.error)
            status = RequestStatus.FINISHED_ABORTED
        return self.scheduler.finish_requests(seq.request.request_id, status)

    def _fork(self, parent: CoreSequence, token: int,
              matcher: GrammarMatcher | None) -> tuple[CoreSequence, list[Request]]:
        """A new sequence off parent, ending in token instead of parent's last token; matcher:
        its grammar's state before token (a fork of the parent's)."""
        child = parent.group.fork(parent, token)
        child.matcher = matcher
        request = child.request
        if parent.request.status is RequestStatus.RUNNING:
            self.scheduler.fork_request(parent.request, request)
        else:  # the parent finished and gave its blocks back: the child recomputes the prompt
            self.scheduler.add_request(request)
        self._seqs[request.request_id] = child
        status = self.scheduler.stop_status(request, token)
        finished = self.scheduler.finish_requests(request.request_id, status) if status else []
        return child, finished + self._advance_grammar(child, token)

    def _retire(self, seq: CoreSequence) -> None:
        """Forget a finished sequence; its group too once every sequence of it has finished."""
        self._seqs.pop(seq.request.request_id, None)
        group = seq.group
        group.num_finished += 1
        if group.finished:
            self._groups.pop(group.request_id, None)
            self._collecting_prompt_logprobs.pop(group.request_id, None)

    def _fail(self, out: SchedulerOutput) -> list[str]:
        """Abort every request the failed step ran; their ids."""
        request_ids = list(dict.fromkeys(
            self._seqs[s.request.request_id].group.request_id for s in out.scheduled
            if s.request.request_id in self._seqs))
        logger.exception("engine step failed; aborting its %d requests", len(request_ids))
        self.abort_requests(request_ids)
        return request_ids

    # -- figures ------------------------------------------------------------------------------
    def block_map(self) -> BlockMap:
        """Every KV block's state, ref count, fill and owners (the dashboard's picture)."""
        return self.kv_manager.block_map()

    def stats(self) -> EngineCoreStats:
        scheduler = self.scheduler
        return EngineCoreStats(
            kv=self.kv_manager.stats(), num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + len(self._awaiting_grammar),
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_computed_tokens=self._num_computed_tokens, kv_cache_dtype=self.kv_cache_dtype,
            step_num_requests=self._step_num_requests,
            step_num_used_blocks=self._step_num_used_blocks)


def _takes_argmax(seq: CoreSequence) -> bool:
    """Whether the sequence's next token is its logits' argmax alone (no grammar, no fan-out)."""
    return seq.matcher is None and seq.group.fan_out == 1 and takes_argmax(seq.row)


def _output(seq: CoreSequence, token: int, logprobs: TokenLogprobs | None) -> EngineCoreOutput:
    # The prompt's prefix-cache hit and first run, as its first sequence had them.
    first = seq.group.seqs[0].request
    return EngineCoreOutput(seq.group.request_id, seq.index, [token],
                            None if logprobs is None else [logprobs],
                            num_cached_tokens=first.num_cached_tokens,
                            first_scheduled_time=first.first_scheduled_time)


def _free_device_bytes(device: torch.device) -> int | None:
    """Memory still free on a GPU once the weights are loaded (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free
