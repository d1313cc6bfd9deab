"""A baseline served from another interpreter: its worker script (bench/vllm_worker.py,
bench/llama_cpp_worker.py) runs in the rival's own venv and speaks JSON lines on stdin / stdout,
one reply per message; the first message sets it up, end of input ends it with a final line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pagedllm.bench.workload import BenchRequest


class WorkerSession:
    system: str  # the rival's name, in errors
    # Said when the worker dies: where its own error went (what it printed before).
    exit_hint = "its error is above"

    def __init__(self, python: str, worker: Path, setup: dict, env: dict | None = None) -> None:
        self.process = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._ask(setup)  # the worker's reply to its setup
        self.token_ids: list[list[int]] = []  # what the last batched run generated, request by request
        self.cpu_s: float | None = None  # the last batched run's CPU seconds, all the rival's processes

    def _ask(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the {self.system} worker exited (code {self.process.wait()}); "
                               f"{self.exit_hint}")
        return json.loads(reply)

    def batched(self, requests: list[BenchRequest]) -> float:
        """Every request at once; the seconds they took (outputs and CPU time kept)."""
        reply = self._ask({"requests": [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                        for r in requests]})
        self.token_ids, self.cpu_s = reply["token_ids"], reply["cpu_s"]
        return reply["elapsed_s"]

    def close(self) -> dict:
        """End the worker; its final figures (peak RSS and the like)."""
        self.process.stdin.close()
        final = json.loads(self.process.stdout.readline() or "{}")
        self.process.wait()
        return {k: v for k, v in final.items() if k != "done"}
