"""use_beam_search on /v1/completions and /v1/chat/completions, with vLLM's fields: n is the beam
width, length_penalty and early_stopping as in pagedllm.entrypoints.beam_search.

The offline search drives an idle engine core itself (its own steps, its own choice of tokens); the
serving core is shared with every other client, so here each beam's next tokens come from an
ordinary one-token request of the prompt and the beam so far, asking for its 2W best logprobs
(the sampler's log-softmax of the raw logits, as the offline search takes them), and the prefix
cache keeps those requests from recomputing the shared history. The beams are picked by the
offline search's own rules (select_candidates, beam_score, best_sequences), so a request gets the
offline search's beams. The answer is the W best finished hypotheses as the choices (streamed as
one chunk each: a beam is not known until the search ends).

What a beam search cannot honour (sampling settings, logprobs, stop strings, constraints) is
refused with a 400 naming the field rather than ignored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.engine.input_processor import InputProcessor, InvalidInput
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.entrypoints.beam_rules import (
    BeamSequence,
    beam_score,
    best_sequences,
    select_candidates,
)
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_bounds import MAX_LOGPROBS
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.async_engine import AsyncEngine, QueueFullError, RequestFailed
from pagedllm.server.protocol import APIError
from pagedllm.server.streams import last_output

# Body fields a beam search cannot honour, with the values that mean "not asked for".
_NOT_WITH_BEAMS: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None,), "prompt_logprobs": (None,), "echo": (False,),
    "logprob_token_ids": (None,),
    "stop": (None, []), "stop_token_ids": (None, []), "bad_words": (None, []), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "min_tokens": (0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (None, 1.0), "top_p": (None, 1.0),
    "top_k": (None, 0, -1), "min_p": (None, 0.0), "temperature": (None, 0.0, 1.0),
    "response_format": (None,), "structured_outputs": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "tool_choice": (None, "none", "auto"), "thinking_token_budget": (None,),
}


@dataclass(frozen=True)
class BeamSettings:
    width: int
    length_penalty: float
    early_stopping: bool
    skip_special_tokens: bool
    ignore_eos: bool  # beams end only at max_tokens


def beam_settings(body, logprobs_cap: int = MAX_LOGPROBS) -> BeamSettings:
    """The body's beam search, checked: a 400 naming the first field it cannot honour.
    logprobs_cap: the most alternatives the server lists (InputProcessor.logprobs_cap)."""
    for name, off in _NOT_WITH_BEAMS.items():
        if hasattr(body, name) and getattr(body, name) not in off:
            raise APIError(f"{name} is not available with use_beam_search (a beam search scores the "
                           "model's own log-probabilities and returns whole beams); leave it out",
                           param=name)
    # Each beam asks for its 2W best next tokens as logprobs, which are capped: by the server's
    # --max-logprobs, and by the default cap even where that is raised (a width of 10 is past any
    # beam search's use, and each beam's request lists its 2W alternatives at every step).
    alternatives = min(MAX_LOGPROBS, logprobs_cap)
    if body.n > alternatives // 2:
        raise APIError(f"n is the beam width with use_beam_search: at most {alternatives // 2} (each "
                       f"beam asks for its 2n best next tokens, at most {alternatives}); got {body.n}",
                       param="n")
    return BeamSettings(body.n, body.length_penalty, body.early_stopping, body.skip_special_tokens,
                        body.ignore_eos)


@dataclass
class _Beam:
    token_ids: list[int]
    cum_logprob: float = 0.0


class ServerBeamSearch:
    """One prompt's beam search over the serving engine."""

    def __init__(self, engine: AsyncEngine, processor: InputProcessor, request: EngineCoreRequest,
                 prompt: str | None, settings: BeamSettings) -> None:
        self.engine = engine
        self.processor = processor
        self.request = request  # the prompt, tokenized, with max_tokens fitted to the context
        self.prompt = prompt
        self.settings = settings
        self.max_tokens = request.sampling_params.max_tokens
        self.eos_ids = () if settings.ignore_eos else tuple(request.eos_token_ids)
        # One token, greedy, its 2W best alternatives; EOS ends beams here, not in the core.
        self.step_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                          logprobs=2 * settings.width)
        self.num_steps = 0

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The search's one (final) output: the W best finished beams as its outputs."""
        yield await self.run()

    async def run(self) -> RequestOutput:
        width = self.settings.width
        beams, finished = [_Beam([])], []
        while beams:
            tops = await asyncio.gather(*(self._next_tokens(beam) for beam in beams))
            candidates = [(beam.cum_logprob + value, token, j)
                          for j, beam in enumerate(beams) for token, value in tops[j]]
            going_on, ending = select_candidates(sorted(candidates, key=lambda c: -c[0]), width, self.eos_ids)
            finished += [self._sequence(beams[j].token_ids + [token], cum, "stop")
                         for cum, token, j in ending]
            if self.settings.early_stopping and len(finished) >= width:
                break
            extended = [_Beam(beams[j].token_ids + [token], cum) for cum, token, j in going_on]
            finished += [self._sequence(b.token_ids, b.cum_logprob, "length") for b in extended
                         if len(b.token_ids) >= self.max_tokens]
            beams = [b for b in extended if len(b.token_ids) < self.max_tokens]
        return self._output(best_sequences(finished, width))

    async def _next_tokens(self, beam: _Beam) -> list[tuple[int, float]]:
        """The 2W likeliest next tokens after the prompt and beam, best first."""
        self.num_steps += 1
        request_id = f"{self.request.request_id}-beam-{self.num_steps}"
        try:
            base = self.request  # the steps run as the search's own request would: salt, adapter, priority
            _, request = self.processor.process(request_id, [*base.prompt_token_ids, *beam.token_ids],
                                                self.step_params, cache_salt=base.cache_salt,
                                                lora_request=base.lora, priority=base.priority)
            stream = await self.engine.generate(request, None)
        except (InvalidInput, ValueError, QueueFullError) as exc:  # the 200 may be out: fail the stream
            raise RequestFailed(f"the beam search could not go on: {exc}") from exc
        final = await last_output(stream)
        entry = final.outputs[0].logprobs[0]
        return [(token, lp.logprob) for token, lp in sorted(entry.items(), key=lambda item: item[1].rank)
                ][:2 * self.settings.width]

    def _sequence(self, token_ids: list[int], cum: float, reason: str) -> BeamSequence:
        text = self.processor.tokenizer.decode(token_ids,
                                               skip_special_tokens=self.settings.skip_special_tokens)
        return BeamSequence(token_ids, cum, beam_score(cum, len(token_ids), self.settings.length_penalty),
                            text, reason)

    def _output(self, beams: list[BeamSequence]) -> RequestOutput:
        outputs = [CompletionOutput(i, beam.text, beam.token_ids, beam.finish_reason,
                                    cumulative_logprob=beam.cum_logprob) for i, beam in enumerate(beams)]
        metrics = RequestMetrics(self.request.arrival_time, finished_time=time.monotonic(),
                                 num_output_tokens=max((len(b.token_ids) for b in beams), default=0))
        return RequestOutput(self.request.request_id, self.prompt, list(self.request.prompt_token_ids),
                             outputs, True, metrics)
