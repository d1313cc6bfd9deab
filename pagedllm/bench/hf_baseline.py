"""The transformers baseline: `generate` on the engine's device, in static batches with left
padding, on the same weights (bench/hf_model.py). A batch runs until its longest request is done;
only each request's own max_tokens count as useful output."""

from __future__ import annotations

import time

import torch

from pagedllm.bench.common import device_name, peak_gpu_memory
from pagedllm.bench.workload import BenchRequest

SYSTEM = "transformers"
SCENARIOS = ("batched",)


def add_args(parser) -> None:
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="static batch size for the HF baseline (default: every request at once)")


class Session:
    def __init__(self, engine, batch_size: int | None, temperature: float = 0.0):
        from pagedllm.bench.hf_model import load_hf_model

        started = time.time()
        self.device = engine.device
        self.model = load_hf_model(engine.model_path, engine.dtype).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.batch_size = batch_size
        # Sampling as ours does: the whole vocabulary (transformers' default top_k is 50).
        self.sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
            if temperature > 0 else dict(do_sample=False)
        self.pad_id = engine.tokenizer.eos_token_id or 0
        self.info = {"load_s": round(time.time() - started, 2), "device": device_name(self.device),
                     "dtype": str(engine.dtype).removeprefix("torch.")}

    def batched(self, requests: list[BenchRequest]) -> float:
        batch_size = self.batch_size or len(requests)
        self.info["batch_size"] = batch_size
        started = time.perf_counter()
        with torch.inference_mode():
            for start in range(0, len(requests), batch_size):
                self._generate(requests[start:start + batch_size])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.info.update(peak_gpu_memory(self.device))
        return time.perf_counter() - started

    def _generate(self, batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        longest = max(r.max_tokens for r in batch)
        self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=longest,
                            min_new_tokens=longest, pad_token_id=self.pad_id, **self.sampling)

    def close(self) -> dict:
        return {}


def start(engine, args, requests: list[BenchRequest]) -> Session:
    return Session(engine, args.hf_batch_size, args.temperature)
