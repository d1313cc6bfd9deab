"""A pooling engine's step (EngineConfig.runner "pooling"): the scheduled prompt chunks run as in
any step, but nothing samples. The executor hands each chunk's final hidden states to the pooler;
a request whose last chunk ran gets its vector and finishes ("stop") with no token, its blocks
given back (their full blocks stay in the prefix cache for the next prompt that shares them).
"""

from __future__ import annotations

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.core_requests import CoreRequests
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.worker.executor import LocalExecutor


def check_pooling_request(request: EngineCoreRequest, pooling_engine: bool) -> None:
    """ValueError for a request the engine cannot run: a pooling request to a generation engine,
    or the reverse."""
    if pooling_engine and request.pooling is None:
        raise ValueError("this engine was started with --runner pooling: it returns embeddings and "
                         "scores, not generated tokens")
    if not pooling_engine and request.pooling is not None:
        raise ValueError("this engine generates tokens: embeddings and scores need an engine "
                         "started with --runner pooling (or --task embed|score)")


def run_pooling_step(out: SchedulerOutput, scheduler: Scheduler, executor: LocalExecutor,
                     requests: CoreRequests) -> list[EngineCoreOutput]:
    pooling = {}
    for s in out.scheduled:
        s.samples = False  # its vector comes from the hidden states: no logits, no token
        pooling[s.request.request_id] = requests.seqs[s.request.request_id].group.request.pooling
    pooled = executor.execute(out, pooling=pooling).pooled
    for s in out.scheduled:
        if s.request.request_id in pooled:  # computed now: its full blocks go to the prefix cache
            s.request.num_computed_tokens = s.num_context_tokens
    finished = scheduler.finish_requests(list(pooled), RequestStatus.FINISHED_STOPPED)
    scheduler.update_from_output(out, {})  # the other chunks count as computed
    outputs = []
    for request in finished:
        outputs.append(EngineCoreOutput(
            request.request_id, 0, [], finish_reason=RequestStatus.FINISHED_STOPPED.value,
            num_cached_tokens=request.num_cached_tokens, first_scheduled_time=request.first_scheduled_time,
            pooled=pooled[request.request_id]))
        requests.retire(requests.seqs[request.request_id])
    return outputs
