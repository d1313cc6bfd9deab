"""The engine: glue between scheduler, runner, sampler and detokenizer. One `step()` is one
batch: schedule, run the model, sample, feed tokens back, report what changed."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import psutil
import torch

from pagedllm.attention import kv_cache_bytes_per_block
from pagedllm.config import EngineConfig, SchedulerConfig, parse_size
from pagedllm.device import resolve_device
from pagedllm.kv.contiguous import ContiguousKVManager
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model.loader import load_model, resolve_dtype
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.runner import ModelRunner
from pagedllm.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler, SchedulerOutput
from pagedllm.sequence import SequenceState

logger = logging.getLogger(__name__)

DEFAULT_KV_SHARE_OF_FREE_RAM = 0.2
DEFAULT_KV_CAP_BYTES = 4 * 2**30
# On a GPU: this share of the device memory still free once the weights are loaded (the rest is
# for activations, the sampler and other processes).
DEFAULT_KV_SHARE_OF_FREE_GPU = 0.5

PromptInput = str | list[int] | dict


@dataclass
class RequestGroup:
    """One user request: its n sequences (index 0 is the one that prefills the prompt)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    forked: bool = False

    @property
    def finished(self) -> bool:
        # Until the prompt has been sampled and forked, only sequence 0 exists.
        expected = self.params.n if self.forked else 1
        return len(self.seqs) == expected and all(s.finish_reason for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config or EngineConfig(**kwargs)
        cfg = self.config
        started = time.monotonic()
        self.device = resolve_device(cfg.device)
        loaded = load_model(cfg.model, cfg.dtype, self.device)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.block_size = cfg.block_size
        mc = self.model_config
        self.bytes_per_block = kv_cache_bytes_per_block(
            mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads, mc.head_dim, self.dtype)
        self.kv_cache_bytes = self._kv_budget_bytes()
        self.num_blocks = self.kv_cache_bytes // self.bytes_per_block
        self._check_fits()
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len),
            self._make_kv_manager())
        self.runner = ModelRunner(
            loaded.model, num_blocks=self.num_blocks, block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len, kv_dtype=self.dtype, device=self.device)
        self.sampler = Sampler(cfg.seed, self.device)
        self._groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, tuple[RequestGroup, SequenceState]] = {}
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.last_step_num_requests = 0
        self.num_computed_tokens_total = 0  # every token run through the model (prefill + decode)
        # The request ids the current (or last) step scheduled; None while unknown, so that a
        # caller catching a failed step can fail just those requests (None: all of them).
        self.step_request_ids: list[str] | None = None
        self.startup_s = time.monotonic() - started
        self._log_memory_plan()

    # -- set-up ------------------------------------------------------------------------------
    def _kv_budget_bytes(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks * self.bytes_per_block
        if self.config.kv_cache_memory is not None:
            return parse_size(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(DEFAULT_KV_SHARE_OF_FREE_GPU * free)
        free = psutil.virtual_memory().available
        return int(min(DEFAULT_KV_CAP_BYTES, DEFAULT_KV_SHARE_OF_FREE_RAM * free))

    def _check_fits(self) -> None:
        blocks_per_request = -(-self.max_model_len // self.block_size)
        if self.num_blocks < blocks_per_request:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {blocks_per_request} blocks of "
                f"{self.block_size} tokens ({blocks_per_request * self.bytes_per_block} bytes), but "
                f"kv_cache_memory={self.kv_cache_bytes} bytes holds only {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_size} tokens): raise kv_cache_memory or lower "
                f"max_model_len")

    def _make_kv_manager(self):
        cfg = self.config
        if cfg.kv_layout == "contiguous":
            return ContiguousKVManager(self.num_blocks, cfg.block_size, self.max_model_len,
                                       reserve=cfg.contiguous_reserve,
                                       bytes_per_block=self.bytes_per_block)
        return KVCacheManager(self.num_blocks, cfg.block_size,
                              enable_prefix_caching=cfg.enable_prefix_caching,
                              bytes_per_block=self.bytes_per_block)

    def _log_memory_plan(self) -> None:
        slots = self.num_blocks * self.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens, %d bytes per block, %d token slots (%.1f MiB, %s, %s "
            "layout); max_model_len=%d fits %d requests at once; start-up %.2fs",
            self.num_blocks, self.block_size, self.bytes_per_block, slots,
            self.num_blocks * self.bytes_per_block / 2**20, str(self.dtype).removeprefix("torch."),
            self.config.kv_layout, self.max_model_len, slots // self.max_model_len, self.startup_s)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput,
                    sampling_params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. Bad input raises ValueError and leaves nothing behind."""
        params = sampling_params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        request = Request(request_id, token_ids, params, eos_token_id=self.tokenizer.eos_token_id,
                          arrival_time=arrival, cache_salt=cache_salt)
        self.scheduler.add_request(request)  # raises on length / capacity problems
        group = RequestGroup(request_id, text, token_ids, params, RequestMetrics(arrival),
                             generators=self._generators(params))
        group.seqs.append(self._new_seq(request, 0, group))
        self._groups[request_id] = group
        self._seqs[request_id] = (group, group.seqs[0])
        self.num_prompt_tokens_total += len(token_ids)

    def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        """The checked token ids of a prompt (ValueError if empty, out of vocabulary or too long)."""
        return self._tokenize(prompt)[1]

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one character or token id")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, prompt
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got "
                             f"{type(prompt).__name__}")
        self._check_token_ids(token_ids)
        return text, list(token_ids)

    def _check_token_ids(self, token_ids) -> None:
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}) (the vocabulary); "
                             f"out of vocabulary: {bad[:5]}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.max_model_len}: shorten it")

    def _generators(self, params: SamplingParams) -> list[torch.Generator | None]:
        if params.seed is None:
            return [None] * params.n
        # Each of the n outputs gets its own stream, so output i is reproducible on its own.
        return [torch.Generator(device=self.device).manual_seed((params.seed + i) % 2**63)
                for i in range(params.n)]

    def _new_seq(self, request: Request, index: int, group: RequestGroup) -> SequenceState:
        params = group.params
        return SequenceState(
            request=request, index=index,
            detokenizer=self.tokenizer.detokenizer(request.prompt_token_ids,
                                                   skip_special_tokens=params.skip_special_tokens),
            generator=group.generators[index], stop=list(params.stop),
            include_stop=params.include_stop_str_in_output)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its n sequences) in any state; frees its blocks at once."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            self._seqs.pop(seq.request.request_id, None)
            self.scheduler.abort_request(seq.request.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_request_ids = None
        out = self.scheduler.schedule()
        self.step_request_ids = list(dict.fromkeys(
            self._seqs[s.request.request_id][0].request_id for s in out.scheduled))
        self.last_step_num_requests = len(out.scheduled)
        self.num_computed_tokens_total += out.num_batched_tokens
        self.runner.drop_requests(out.finished + out.preempted)
        if not out.scheduled:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            group = self._seqs[s.request.request_id][0]
            group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
        self.runner.copy_blocks(out.block_copies)
        logits, sample_idx = self.runner.execute(out.scheduled)
        sampled = self._sample(out, logits, sample_idx)
        finished = self.scheduler.update_from_output(
            out, {seq.request.request_id: token for _, seq, k, token, _ in sampled if k == 0})
        per_seq = []
        for group, seq, k, token, logprobs in sampled:
            if k > 0:  # the k-th of n outputs, sampled from its parent's prompt logits
                seq, child_finished = self._fork_child(group, seq.request, k, token)
                finished += child_finished
            per_seq.append((seq, token, logprobs))
        return self._process_samples(per_seq, finished)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, sample_idx: list[int]):
        """One token per sampling sequence; a prompt with n > 1 draws n tokens from its logits
        (its parent sequence takes the first, children forked after the update the rest)."""
        rows, logit_rows, targets = [], [], []
        for j, i in enumerate(sample_idx):
            request = out.scheduled[i].request
            group, seq = self._seqs[request.request_id]
            fan_out = group.params.n if group.params.n > 1 and not group.forked else 1
            group.forked = group.forked or fan_out > 1
            for k in range(fan_out):
                generator = group.generators[k] if k else seq.generator
                rows.append(self._sampling_row(request, group.params, generator))
                logit_rows.append(j)
                targets.append((group, seq, k))
        if not rows:
            return []
        if logit_rows != list(range(len(logits))):  # n > 1 repeats a row; otherwise keep the view
            logits = logits.index_select(0, torch.tensor(logit_rows, device=logits.device))
        result = self.sampler(logits, rows)
        return [(g, s, k, tok, lp) for (g, s, k), tok, lp in zip(targets, result.token_ids, result.logprobs)]

    def _fork_child(self, group: RequestGroup, parent: Request, index: int,
                    token: int) -> tuple[SequenceState, list[Request]]:
        """Start output `index` of a request: it shares the parent's prompt blocks by reference
        count (copy-on-write before either writes into a shared partial block)."""
        child = Request(f"{group.request_id}#{index}", parent.prompt_token_ids,
                        dataclasses.replace(group.params, n=1),
                        eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
                        cache_salt=parent.cache_salt)
        child.append_token(token)
        if parent.status is RequestStatus.RUNNING:
            self.scheduler.fork_request(parent, child)
        else:  # the parent already finished and gave its blocks back: recompute the prompt
            self.scheduler.add_request(child)
        seq = self._new_seq(child, index, group)
        group.seqs.append(seq)
        self._seqs[child.request_id] = (group, seq)
        status = self.scheduler.stop_status(child, token)
        return seq, self.scheduler.finish_requests([child.request_id], status) if status else []

    def _sampling_row(self, req: Request, params: SamplingParams,
                      generator: torch.Generator | None) -> SamplingRow:
        stops = tuple(params.stop_token_ids) + (
            (req.eos_token_id,) if req.eos_token_id is not None and not params.ignore_eos else ())
        return SamplingRow(params, req.prompt_token_ids, req.output_token_ids, stops, generator)

    def _process_samples(self, per_seq: list, finished: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        changed: dict[str, RequestGroup] = {}
        stopped_by_text = []
        for seq, token_id, logprobs in per_seq:
            group = self._seqs[seq.request.request_id][0]
            group.metrics.first_token_time = group.metrics.first_token_time or now
            self.num_generation_tokens_total += 1
            if seq.add_token(token_id, logprobs, self._decode_one) and not seq.request.is_finished:
                stopped_by_text.append(seq.request.request_id)
            changed[group.request_id] = group
        finished = finished + self.scheduler.finish_requests(stopped_by_text, RequestStatus.FINISHED_STOPPED)
        for request in finished:
            group, seq = self._seqs.pop(request.request_id)
            seq.finish(request.status)
            group.metrics.num_preemptions += request.num_preemptions
            changed[group.request_id] = group
        return [self._group_output(g, now) for g in changed.values()]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _group_output(self, group: RequestGroup, now: float) -> RequestOutput:
        finished = group.finished
        if finished:
            group.metrics.finished_time = now
            self._groups.pop(group.request_id, None)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[s.to_output() for s in sorted(group.seqs, key=lambda s: s.index)],
            finished=finished, metrics=group.metrics)

    # -- figures ------------------------------------------------------------------------------
    def memory_stats(self) -> dict:
        stats = self.scheduler.memory_stats()
        stats.setdefault("block_size", self.block_size)
        stats.setdefault("num_blocks", self.num_blocks)
        stats["bytes_per_block"] = self.bytes_per_block
        stats["kv_cache_bytes"] = self.num_blocks * self.bytes_per_block
        return stats
