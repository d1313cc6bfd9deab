"""The engine core's one map of requests: every sequence of every unfinished request, by the
scheduler's request id (RequestGroup names its forks "<request id>#<index>"). A request's first
sequence has the request's own id, so the same map finds a request's group; a group's sequences
stay in it until the whole group has finished, so a finished sequence of a live group is still
found. Beside the map, one count: the requests whose prompt logprobs are not handed out yet, so
that a step with none (nearly every step) spends nothing on them.

A request whose grammar still compiles (a core in a process of its own compiles what it receives)
is in the map but not yet in the scheduler; admit_compiled_grammars hands it over once the grammar
is ready, or ends it if the grammar failed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.engine.request_group import CoreSequence, RequestGroup
from pagedllm.outputs import TokenLogprobs
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.worker.executor import PromptLogprobs

logger = logging.getLogger(__name__)


class CoreRequests:
    def __init__(self) -> None:
        self.seqs: dict[str, CoreSequence] = {}  # read directly on the step's hot path
        self.num_collecting = 0  # requests whose prompt logprobs are due (read every step)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def group(self, request_id: str) -> RequestGroup | None:
        """The unfinished request of that id (a fork's id finds none)."""
        first = self.seqs.get(request_id)
        return first.group if first is not None and first.index == 0 else None

    def request_ids(self) -> list[str]:
        """The unfinished requests' ids, in the order they came."""
        return [request_id for request_id, seq in self.seqs.items() if seq.index == 0]

    def add(self, seq: CoreSequence) -> None:
        """A request's first sequence, or a fork."""
        self.seqs[seq.request.request_id] = seq
        if seq.index == 0:
            self.num_collecting += seq.group.collecting_prompt_logprobs

    def retire(self, seq: CoreSequence) -> None:
        """Count a sequence finished; forget its group once every sequence of it has."""
        seq.group.num_finished += 1
        if seq.group.finished:
            self.forget(seq.group)

    def forget(self, group: RequestGroup) -> None:
        self.num_collecting -= group.collecting_prompt_logprobs
        group.prompt_logprobs_sent = True  # nothing to hand out any more
        for seq in group.seqs:
            self.seqs.pop(seq.request.request_id, None)

    def prompt_logprobs_wanted(self, request_ids: Iterable[str]) -> dict[str, int] | None:
        """Of these requests (scheduler's ids), those whose prompt logprobs are due, with the
        number of top tokens each asks for; None when no request wants any."""
        if not self.num_collecting:
            return None
        seqs = [self.seqs[request_id] for request_id in request_ids]
        return {seq.request.request_id: seq.group.request.sampling_params.prompt_logprobs
                for seq in seqs if seq.index == 0 and seq.group.collecting_prompt_logprobs}

    def record_prompt_logprobs(self, found: dict[str, PromptLogprobs]) -> None:
        """What a step's prompt chunks gave (the executor's output), into their groups."""
        for request_id, (first, values) in found.items():
            self.seqs[request_id].group.record_prompt_logprobs(first, values)

    def take_prompt_logprobs(self, seq: CoreSequence) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs of seq's request, if they are due: once, with its first output."""
        if seq.index != 0 or not self.num_collecting or not seq.group.collecting_prompt_logprobs:
            return None
        self.num_collecting -= 1
        return seq.group.take_prompt_logprobs()

    def admit_compiled_grammars(self, structured: StructuredOutputManager,
                                scheduler: Scheduler) -> list[EngineCoreOutput]:
        """Hand the scheduler the requests whose grammars are now compiled; end those whose
        grammars failed (an "abort" for each output, so the front end hears of it)."""
        refused: list[EngineCoreOutput] = []
        for request_id, result in structured.ready():
            first = self.seqs[request_id]
            if isinstance(result, GrammarMatcher):
                first.matcher = result
                if first.request.lora_key is None or first.request.lora_slot >= 0:  # else: LoRA's wait
                    scheduler.add_request(first.request)
                continue
            logger.error("request %s: its grammar did not compile: %s", request_id, result)
            self.forget(first.group)
            refused += [EngineCoreOutput(request_id, i, [], finish_reason="abort")
                        for i in range(first.group.request.sampling_params.n)]
        return refused
