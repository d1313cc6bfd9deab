"""gpu-check's shared parts: its settings, the Check that runs stages on a clock and gathers the
report, where things go on the device machine, and the shapes and targets it measures against
(tests/gpu_check.py says what the check is)."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_quant_matmul.py",
         "tests/model/test_cuda.py", "tests/worker/test_cuda_graphs.py", "tests/test_device.py"]
SMOKE_TESTS = ["tests/worker/test_cuda_graphs.py::test_capture_sizes",
               "tests/kernels/test_triton_attention.py::test_soft_capped_scores"]
SITE = Path("/tmp/pagedllm-site")  # the carried wheels, installed
MODELS = Path("/tmp/pagedllm-models")  # the random-weight models built here
NEEDED_MODULES = ("gguf", "fastapi", "uvicorn", "pydantic", "llguidance", "zmq", "msgspec")
H200_PEAK_TB_S = 4.8  # HBM3e, the datasheet's
# Llama 3.2 1B's shapes (with the default model's vocabulary, whose tokenizer travels).
LARGE_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
SMOKE_LARGE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TARGETS = {"throughput_ratio": 4.0, "graphs_speedup": 1.5}



@dataclass
class Settings:
    device: str
    out_dir: Path
    budget_s: float
    num_prompts: int
    input_len: str
    output_len: str
    dtype: str
    decode_tokens: int
    large_model: str | None
    roles: tuple[str, ...]  # the models benched: "large" (the ~1B one), "default"
    tests: list[str]
    gguf_default: bool  # the default model from its GGUF where it is here (else random weights)

    @property
    def smoke(self) -> bool:
        return self.device == "cpu"


@dataclass
class Check:
    """The run's report and raw numbers, and its clock."""

    settings: Settings
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def remaining_s(self) -> float:
        return self.settings.budget_s - (time.monotonic() - self.started)

    def stage(self, name: str, needs_s: float, run) -> None:
        """Run one stage, unless less time is left than it needs; a failure is reported, and the
        next stage runs."""
        if self.remaining_s() < needs_s:
            self.lines += [f"## {name}", "", f"SKIPPED: {self.remaining_s():.0f} s left of the budget, "
                           f"it needs about {needs_s:.0f} s", ""]
            self.data.setdefault("skipped", []).append(name)
            return
        print(f"\n=== gpu-check: {name} ({self.remaining_s():.0f} s left)", flush=True)
        started = time.monotonic()
        self.lines += [f"## {name}", ""]
        try:
            run(self)
        except Exception as exc:  # a stage's failure is reported, the others still run
            traceback.print_exc()
            self.failures.append(name)
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.lines.append(f"FAILED: {type(exc).__name__}: {first_line}")
        self.lines += ["", f"({name}: {time.monotonic() - started:.0f} s)", ""]

    def table(self, header: list[str], rows: list[list]) -> None:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]



def _event_median_ms(fn, repeat: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)

