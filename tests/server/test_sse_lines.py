"""One SSE event's data is one line whatever the generated text holds. A random model can emit
U+2028, U+2029 or U+0085, which JSON leaves raw and str.splitlines (httpx's iter_lines, and once
our own chat-to-Anthropic translation) takes for line ends: a client then read half an event."""

from __future__ import annotations

import asyncio
import json

from pagedllm.server.chat_translation import chat_chunks
from pagedllm.server.formats import sse

TEXT = "a\u2028b\u2029c\x85d\u00e9\n\r"


def test_an_event_holding_unicode_line_breaks_splits_into_one_data_line():
    event = sse({"choices": [{"text": TEXT}]})
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"choices": [{"text": TEXT}]}
    assert "\u00e9" in event  # UTF-8 kept, not every character escaped


def test_chat_chunks_reads_an_event_whose_json_holds_a_raw_line_separator():
    raw = "data: " + json.dumps({"text": TEXT}, ensure_ascii=False) + "\n\ndata: [DONE]\n\n"

    async def body():
        yield raw.encode()

    async def read():
        return [chunk async for chunk in chat_chunks(body())]

    assert asyncio.run(read()) == [{"text": TEXT}]
