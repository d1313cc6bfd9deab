"""`pagedllm bench memory --html PATH`: the server's KV cache page as a static report of the
memory bench, paged and contiguous side by side on one time cursor.

Each layout's run records the block map of its steps (FrameRecorder); the page plays them back
with the bench's full-resolution timeline (allocated / used slots, running / waiting) under them.
One self-contained HTML file: it opens offline, from disk, and can be attached anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.server.dashboard_page import render_page

DEFAULT_MAX_FRAMES = 120


class FrameRecorder:
    """The block maps of a run's steps, thinned as the run goes to at most max_frames evenly
    spread ones (every step, then every 2nd, 4th, ...), so memory stays bounded however long
    the run; the final state is always kept."""

    def __init__(self, stats_fn: Callable[[], dict], block_map_fn: Callable[[], BlockMap],
                 max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        if max_frames < 2:
            raise ValueError(f"max_frames must be at least 2; got {max_frames}")
        self.stats_fn = stats_fn
        self.block_map_fn = block_map_fn
        self.max_frames = max_frames
        self.frames: list[dict] = []
        self._stride = 1
        self._num_steps = 0
        self._last_t = 0.0

    def record(self, t: float) -> None:
        """The state after a step that ended at t (seconds, or the step index)."""
        if self._num_steps % self._stride == 0:
            self.frames.append(self._frame(t))
            if len(self.frames) > self.max_frames:
                self.frames = self.frames[::2]
                self._stride *= 2
        self._num_steps += 1
        self._last_t = t

    def finish(self) -> list[dict]:
        """The kept frames, ending with the state after the last step."""
        if self._num_steps and self.frames[-1]["t"] != self._last_t:
            self.frames.append(self._frame(self._last_t))
        return self.frames

    def _frame(self, t: float) -> dict:
        return {"t": t, "stats": self.stats_fn(), "blocks": self.block_map_fn().to_dict()}


def write_report(path: str, payload: dict, frames: dict[str, list[dict]]) -> None:
    """The report of one memory bench run (its JSON payload) with each layout's frames."""
    simulated = payload.get("simulated", False)
    panels = []
    for layout, layout_frames in frames.items():
        figures = payload[layout]
        summary = (f"waste {figures['waste_pct']}% on average, up to {figures['max_running']} "
                   f"requests at once, {figures['num_preemptions']} preemptions")
        if "output_tokens_per_s" in figures:
            summary += f", {figures['output_tokens_per_s']} output tokens/s"
        panels.append({"name": layout, "summary": summary, "frames": layout_frames,
                       "timeline": figures["timeline"], "token_slots": figures["token_slots"]})
    workload = payload["workload"]
    subtitle = (f"{workload['num_requests']} requests, KV budget = {payload['reservations']} x "
                f"{payload['max_model_len']} tokens in {payload['block_size']}-token blocks"
                + (" (simulated: time is in steps)" if simulated else ""))
    data = {"mode": "report", "subtitle": subtitle, "time_unit": "step" if simulated else "s",
            "panels": panels}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_page("KV memory: paged against contiguous", data))
    print(f"report: {path}")
