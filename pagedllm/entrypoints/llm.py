"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.input_processor import Conversation, PromptInput, prompt_list
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.pooling_score import similarity_scores, texts_to_embed
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """model: a Hugging Face folder or a .gguf file (None: the embedded SmolLM2-135M-Instruct);
        kwargs: any EngineConfig option (dtype, block_size, kv_cache_memory, max_model_len,
        max_num_seqs, max_num_batched_tokens, kv_layout, enable_prefix_caching, seed, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no SamplingParams: the library's defaults under
        the model's generation_config.json (unless generation_config="vllm" or "none")."""
        return self.engine.input_processor.default_sampling_params()

    def generate(self, prompts: PromptInput | list[PromptInput],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """lora_request (LLM(enable_lora=True)): the LoRA adapter every prompt runs with, or one
        per prompt (None: the base model); prompts of different adapters share each step.
        priority: one per prompt, lower first (scheduling_policy="priority"; None: all 0)."""
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        request_ids = self._add_all(prompts, params, _per_prompt(lora_request, len(prompts)), priority)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False,
             split_special_tokens: bool = True) -> list[RequestOutput]:
        """Each conversation through the chat template (the model's, or chat_template; see
        InputProcessor.chat_prompt for the options: split_special_tokens=False lets special-token
        text in messages act as control tokens), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.engine.input_processor
        prompts = [processor.chat_prompt(c, add_generation_prompt, chat_template=chat_template,
                                         chat_template_kwargs=chat_template_kwargs,
                                         continue_final_message=continue_final_message,
                                         split_special_tokens=split_special_tokens)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptInput | list[PromptInput], beam_width: int,
                    max_tokens: int, length_penalty: float = 1.0, early_stopping: bool = False) -> list:
        """Beam search; returns one BeamSearchOutput (sequences best first) per prompt.
        early_stopping: a prompt's search ends once it has beam_width finished hypotheses."""
        from pagedllm.entrypoints.beam_search import BeamSearch

        token_lists = [self.engine.input_processor.tokenize(p)[1] for p in prompt_list(prompts)]
        search = BeamSearch(self.engine.engine_core, self.engine.tokenizer, beam_width, max_tokens,
                            length_penalty, early_stopping)
        return search.run(token_lists)

    def embed(self, prompts: PromptInput | list[PromptInput], *, dimensions: int | None = None,
              normalize: bool | None = None, instruction: str | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (an engine started with runner="pooling"): outputs.embedding.
        dimensions: keep the first this many values; normalize None: the engine's
        pooling_normalize; instruction: text put before each text prompt as it is (an embedder's
        query prefix, e.g. Qwen3-Embedding's "Instruct: ...\nQuery:")."""
        prompts = prompt_list(prompts)
        if instruction is not None:
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("instruction goes before text prompts: give the prompts as text")
            prompts = [instruction + p for p in prompts]
        params = self.engine.input_processor.pooling_params("embed", dimensions, normalize)
        return self._run(self._add_pooling(prompts, params), use_tqdm)

    def score(self, query: str, documents: str | list[str], *, instruction: str | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """How well each document answers the query, in the documents' order: from 0 to 1 as a
        reranker judges it (Qwen3-Reranker's way, pagedllm.text.score_prompt, or a classifier's
        head); on an embedder's engine (task="embed"), the cosine similarity of their embeddings
        (pagedllm.pooling_score; instruction then prefixes the query alone)."""
        documents = [documents] if isinstance(documents, str) else list(documents)
        processor = self.engine.input_processor
        if processor.pooling is not None and processor.pooling.scores_by_similarity:  # an embedder
            return self._similarity_scores(query, documents, instruction, use_tqdm)
        params = processor.pooling_params("score")
        prompts = [processor.score_input(query, d, instruction) for d in documents]
        outputs = self._run(self._add_pooling(prompts, params), use_tqdm)
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.data[-1]))
                for o in outputs]

    def _similarity_scores(self, query: str, documents: list[str], instruction: str | None,
                           use_tqdm: bool) -> list[ScoringRequestOutput]:
        pairs = [(query, d) for d in documents]
        texts = texts_to_embed(pairs, instruction)
        params = self.engine.input_processor.pooling_params("embed", normalize=True)
        outputs = self._run(self._add_pooling(texts, params), use_tqdm)
        scores = similarity_scores(pairs, instruction, {t: o.outputs.data for t, o in zip(texts, outputs)})
        by_text = dict(zip(texts, outputs))
        return [ScoringRequestOutput(by_text[d].request_id, by_text[d].prompt_token_ids, ScoringOutput(s))
                for d, s in zip(documents, scores)]

    def reward(self, prompts: PromptInput | list[PromptInput], *,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's reward: a reward model's (a *ForSequenceClassification checkpoint's) raw
        label logits at its last token, in outputs.data."""
        params = self.engine.input_processor.pooling_params("reward")
        return self._run(self._add_pooling(prompt_list(prompts), params), use_tqdm)

    def memory_stats(self) -> dict:
        return self.engine.memory_stats()

    def _add_all(self, prompts: list[PromptInput], params: list[SamplingParams],
                 loras: list[LoRARequest | None], priorities: list[int]) -> list[str]:
        """Add every prompt, or none: a bad prompt aborts the ones already queued."""
        add = self.engine.add_request
        return self._add_each([(functools.partial(add, lora_request=lora, priority=priority), prompt, p)
                               for prompt, p, lora, priority in zip(prompts, params, loras, priorities)])

    def _add_pooling(self, prompts: list[PromptInput], params: PoolingParams) -> list[str]:
        return self._add_each([(self.engine.add_pooling_request, prompt, params) for prompt in prompts])

    def _add_each(self, adds: list) -> list[str]:
        """Each (add, prompt, params) with a new request id, or none: a bad prompt aborts the ones
        already queued."""
        added: list[str] = []
        try:
            for add, prompt, params in adds:
                request_id = str(next(self._ids))
                add(request_id, prompt, params)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        started = time.monotonic()
        tokens_before = self.engine.stats().num_generation_tokens
        try:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
                if use_tqdm:
                    elapsed = max(time.monotonic() - started, 1e-9)
                    generated = self.engine.stats().num_generation_tokens - tokens_before
                    bar.set_postfix_str(f"~{generated / elapsed:.0f} tok/s")
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _per_prompt(lora: LoRARequest | list[LoRARequest | None] | None, count: int) -> list:
    """One lora_request (or None) per prompt."""
    if not isinstance(lora, list):
        lora = [lora] * count
    elif len(lora) != count:
        raise ValueError(f"got {len(lora)} lora_requests for {count} prompts")
    for item in lora:
        if item is not None and not isinstance(item, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None; got {item!r}")
    return lora


def _params_per_prompt(params: SamplingParams | list[SamplingParams], count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, each asking for its final output only (all generate
    returns); the caller's objects are left as they are."""
    if isinstance(params, SamplingParams):
        params = [params] * count
    elif len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    final: dict[int, SamplingParams] = {}  # one copy per distinct object
    for p in params:
        if id(p) not in final:
            final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
    return [final[id(p)] for p in params]
