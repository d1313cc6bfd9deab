"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine, PromptInput
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Conversation = list[dict]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 kv_cache_memory: int | str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 kv_layout: str = "paged", seed: int = 0, enable_prefix_caching: bool = True,
                 device: str = "auto", **kwargs) -> None:
        config = EngineConfig(model=model, dtype=dtype, block_size=block_size,
                              kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              kv_layout=kv_layout, seed=seed,
                              enable_prefix_caching=enable_prefix_caching, device=device, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | list[PromptInput],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        request_ids = self._add_all(prompts, params)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode(
                        tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                        add_special_tokens=False)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptInput | list[PromptInput], beam_width: int,
                    max_tokens: int, length_penalty: float = 1.0) -> list:
        """Beam search; returns one BeamSearchOutput (sequences best first) per prompt."""
        from pagedllm.beam_search import BeamSearch

        token_lists = [self.engine.prompt_token_ids(p) for p in _as_list(prompts)]
        return BeamSearch(self.engine, beam_width, max_tokens, length_penalty).run(token_lists)

    def memory_stats(self) -> dict:
        return self.engine.memory_stats()

    def _add_all(self, prompts: list[PromptInput], params: list[SamplingParams]) -> list[str]:
        """Add every prompt, or none: a bad prompt aborts the ones already queued."""
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        started, generated = time.monotonic(), 0
        try:
            while pending:
                for output in self.engine.step():
                    generated += 1
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
                if use_tqdm:
                    elapsed = max(time.monotonic() - started, 1e-9)
                    bar.set_postfix_str(f"~{generated / elapsed:.0f} tok/s")
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)
