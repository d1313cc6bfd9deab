"""The channel between the API process and the engine core process: what crosses it, how it is
encoded, and where its sockets live.

Two ZMQ sockets over Unix domain sockets in a directory only this user can open (mode 0700, made
by the API process, which binds both; the core connects):

  to the core    (PUSH -> PULL)  AddRequest, Abort, AbortSequences, SnapshotRequest, LoadLoRA,
                                 Shutdown,
                                 and the message types of the extensions the core was started
                                 with (pagedllm.engine.core_process, --extension); a core
                                 without one refuses them as it refuses any unknown message
  from the core  (PUSH -> PULL)  Ready or StartupFailed once; then AddsTaken as soon as it has
                                 taken new requests (before it steps), one StepReport per step
                                 (every sequence's new token ids, the requests a failed step
                                 ended, the core's figures), SnapshotReply and LoRALoaded
                                 answers, and Dead
                                 before the core gives up

What a request carries: its token ids and the SamplingParams as plain data: logit_bias and
allowed_token_ids (ids and numbers), bad_words as token ids, prompt_logprobs (a count), and a
grammar constraint as its GrammarSpec (kind and text, never a compiled grammar: the core compiles
it with its own compiler and owns each sequence's matcher). Back come logprobs and the prompt's
logprobs (with the first token) as numbers; text is made in the API process.

Grammars are compiled on both sides, on purpose: the API process compiles a request's spec
before sending it (server/structured.py, off the event loop, cached), so a schema that does not
compile is a 400 before the request exists anywhere; the core compiles it again from the spec
(a few ms on its compile thread, holding back only that request). An error reply from the core
instead would make every constrained request's add wait on the core's compile, and the adds'
answers come out of order (AddsTaken counts them in order).

Why this shape: the core must never wait for the API process (a slow client or a busy event loop
must not slow the model down), so nothing the core sends needs an answer, and one message per
step carries the news of every request in it, never one message per token. Every message is a
msgspec Struct of plain data (ids, numbers, strings, bytes) encoded with msgpack, decoded into
its declared type or refused: nothing is ever unpickled, so a message cannot make either process
run code. A message that does not decode is logged and dropped by whoever received it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import msgspec

from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingSetup

# -- to the core ---------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag="abort"):
    """End these requests (all their sequences); their blocks go back at once."""

    request_ids: list[str]


class AbortSequences(msgspec.Struct, tag="abort_sequences"):
    """End single sequences (request id, output index): those a stop string finished."""

    sequences: list[tuple[str, int]]


class SnapshotRequest(msgspec.Struct, tag="snapshot"):
    """The figures and the KV block map, taken between two steps (the dashboard's picture)."""

    call_id: int


class LoadLoRA(msgspec.Struct, tag="load_lora"):
    """Read and check a LoRA adapter now (/v1/load_lora_adapter), kept read for its requests."""

    call_id: int
    lora: LoRARequest


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Abort whatever is left, report it, and exit."""


ToCore = AddRequest | Abort | AbortSequences | SnapshotRequest | LoadLoRA | Shutdown

# -- from the core -------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    """The model is loaded and the KV cache allocated: what the API process needs to check and
    tokenize requests, and the start-up line it prints."""

    pid: int
    model_path: str
    description: str  # the KV plan's start-up line
    startup_s: float  # the core process's start to ready
    max_model_len: int
    vocab_size: int
    num_threads: int  # torch threads the core computes with
    device: str
    dtype: str
    stats: EngineCoreStats
    pooling: PoolingSetup | None = None  # a pooling engine's (--runner pooling)
    max_concurrency: int = 0  # requests max_model_len long the KV cache holds at once (KVPlan's)


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    """The core could not start; user_error: the message says what the user must change (a bad
    model path, a damaged file, a cache too small), else a bug (the core logged its traceback)."""

    message: str
    user_error: bool


class AddsTaken(msgspec.Struct, tag="taken"):
    """Sent as soon as the core has taken new requests, before it steps: a client need not wait
    a whole step to hear that its request was accepted, and the API process counts requests
    it sent but the core has not taken (the waiting-queue limit)."""

    num_added: int  # AddRequests taken since start (accepted or rejected), in the order sent
    rejected: list[tuple[str, str]] = []  # (request id, why) of the adds the core refused


class StepReport(msgspec.Struct, tag="step"):
    """One step's outputs, or what aborts did, and the figures after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats  # the figures now
    failed: list[str] = []  # requests a failed step ended (their blocks are back already)
    failure: str | None = None  # why that step failed


class SnapshotReply(msgspec.Struct, tag="snapshot"):
    call_id: int
    stats: EngineCoreStats
    blocks: BlockMap  # its per-block bytes cross raw (msgpack bin), not as base64


class LoRALoaded(msgspec.Struct, tag="lora_loaded"):
    """LoadLoRA's answer: error None, or why the adapter cannot be served (one line naming it)."""

    call_id: int
    error: str | None = None


class Dead(msgspec.Struct, tag="dead"):
    """The core gives up (too many failed steps in a row) and exits."""

    reason: str


FromCore = Ready | StartupFailed | AddsTaken | StepReport | SnapshotReply | LoRALoaded | Dead


class Codec:
    """msgpack both ways, each side decoding only the messages it may receive."""

    def __init__(self, receives: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        """The message; msgspec.DecodeError (a ValidationError among them) if data is not one."""
        return self._decoder.decode(data)


class Addresses:
    """The two sockets' addresses, in a fresh directory that only this user can enter."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="pagedllm-core-")  # mode 0700
        self.to_core = f"ipc://{os.path.join(self.directory, 'to-core')}"
        self.from_core = f"ipc://{os.path.join(self.directory, 'from-core')}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
