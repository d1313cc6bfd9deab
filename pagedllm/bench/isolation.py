"""`pagedllm bench isolation`: how much one hostile but fair client slows another (issue 32).

Against a running server: a watching client streams greedy completions one after another; its
gaps between streamed tokens are measured idle, then under each attack in turn, each for
--attack-s seconds, with a tiny one-token request sent midway (its latency and status reported).
One line per attack: the watcher's median and p90 gap, their ratio to the idle median (the issue
asks for at most 2x), and the tiny request's answer. Timing is the machine's: run it alone.

The attacks are the probe's findings 3-7:
- grammar: streamed requests constrained to a regex of large bounded repeats, n=4 (finding 3);
- big: one completion of 64 prompts x n=4 x 1,000 tokens, the most sequences one request may ask
  for (finding 4; the probe's 64 x n=64 is now refused);
- prompt-logprobs: 16 prompts of long text with prompt_logprobs=20, over and over (finding 5);
- logit-bias: four 0.6 MB logit_bias bodies at once, over and over (finding 7);
- sse: 150 dashboard event readers (finding 7).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx

from pagedllm.bench.common import write_json

REFUSED_PAUSE_S = 0.05
ATTACKS = ("grammar", "big", "prompt-logprobs", "logit-bias", "sse")
WATCH_BODY = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0, "stream": True}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--attack-s", type=float, default=15.0, help="seconds under each attack")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle measurement")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated: {ATTACKS}")
    parser.add_argument("--watch-tokens", type=int, default=64, help="tokens per watching stream")
    parser.add_argument("--attack-tokens", type=int, default=1000,
                        help="max_tokens of the attacks' requests (big, grammar)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        raise SystemExit(f"--attacks: unknown {unknown}; choose from {ATTACKS}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    results = asyncio.run(_run(args, attacks))
    for row in results:
        print(_line(row))
    if args.output_json:
        write_json(args.output_json, {"results": results})
    return 0


async def _run(args, attacks: list[str]) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=300,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        watch = {**WATCH_BODY, "max_tokens": args.watch_tokens}
        idle = await _measure(client, watch, None, args.idle_s)
        rows = [{"attack": "idle", **idle}]
        for name in attacks:
            row = await _measure(client, watch, _attack(name, args.attack_tokens), args.attack_s)
            row["ratio_to_idle"] = row["gap_p50_ms"] / idle["gap_p50_ms"] if idle["gap_p50_ms"] else None
            rows.append({"attack": name, **row})
        return rows


async def _measure(client: httpx.AsyncClient, watch: dict, attack, seconds: float) -> dict:
    """The watcher's gaps (and a tiny request midway) while `attack` runs for `seconds`."""
    stop = asyncio.Event()
    gaps: list[float] = []
    attack_statuses: list[int] = []
    watcher = asyncio.create_task(_watch(client, watch, stop, gaps))
    attacker = asyncio.create_task(attack(client, stop, attack_statuses)) if attack else None
    await asyncio.sleep(seconds / 2)
    tiny = await _tiny(client)
    await asyncio.sleep(seconds / 2)
    stop.set()
    if attacker is not None:  # its requests end now: closing their connections aborts them
        attacker.cancel()
        await asyncio.gather(attacker, return_exceptions=True)
    await watcher
    ms = sorted(g * 1e3 for g in gaps)
    return {"gaps": len(ms), "gap_p50_ms": statistics.median(ms) if ms else None,
            "gap_p90_ms": ms[int(0.9 * (len(ms) - 1))] if ms else None, **tiny,
            "attack_statuses": sorted(set(attack_statuses))}


async def _watch(client, body: dict, stop: asyncio.Event, gaps: list[float]) -> None:
    while not stop.is_set():
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now


async def _tiny(client) -> dict:
    started = time.perf_counter()
    try:
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                     timeout=120)
        status = response.status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return {"tiny_status": status, "tiny_s": time.perf_counter() - started}


Attack = Callable[[httpx.AsyncClient, asyncio.Event, list], Awaitable[None]]


def _repeat(body_fn, concurrency: int, path: str = "/v1/completions", stream: bool = False) -> Attack:
    """An attack that keeps `concurrency` requests of body_fn() in flight until stopped."""
    async def one(client, stop, statuses) -> None:
        while not stop.is_set():
            try:
                if stream:
                    async with client.stream("POST", path, json=body_fn()) as response:
                        statuses.append(response.status_code)
                        async for _ in response.aiter_lines():
                            if stop.is_set():
                                break
                else:
                    statuses.append((await client.post(path, content=body_fn(),
                                                       headers={"Content-Type": "application/json"}
                                                       )).status_code)
                if statuses[-1] >= 400:  # refused: send again, but leave this machine's cores
                    await asyncio.sleep(REFUSED_PAUSE_S)  # to the server, not to a client loop
            except httpx.HTTPError:
                statuses.append(0)
                await asyncio.sleep(0.1)

    async def attack(client, stop, statuses) -> None:
        await asyncio.gather(*(one(client, stop, statuses) for _ in range(concurrency)))

    return attack


def _grammar_body(tokens: int) -> dict:
    return {"prompt": "a", "max_tokens": tokens, "n": 4, "stream": True,
            "structured_outputs": {"regex": "(a{1000}){400}"}}


@functools.cache
def _big_body(tokens: int) -> bytes:
    return json.dumps({"prompt": ["Tell me a story"] * 64, "n": 4, "max_tokens": tokens,
                       "ignore_eos": True}).encode()


@functools.cache  # built once: building it in the bench's event loop would delay the watcher
def _prompt_logprobs_body() -> bytes:
    text = " ".join(f"word{i}" for i in range(300))
    return json.dumps({"prompt": [text] * 16, "max_tokens": 1, "prompt_logprobs": 20}).encode()


@functools.cache
def _logit_bias_body() -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 1,
                       "logit_bias": {str(i): 1.0 for i in range(40_000)}}).encode()


async def _sse_readers(client, stop, statuses) -> None:
    async def reader() -> None:
        while not stop.is_set():
            try:
                async with client.stream("GET", "/dashboard/events") as response:
                    statuses.append(response.status_code)
                    async for _ in response.aiter_lines():
                        if stop.is_set():
                            return
                    if response.status_code != 200:
                        await asyncio.sleep(1)
            except httpx.HTTPError:
                statuses.append(0)
                await asyncio.sleep(0.1)

    await asyncio.gather(*(reader() for _ in range(150)))


def _attack(name: str, tokens: int) -> Attack:
    if name == "grammar":
        return _repeat(lambda: _grammar_body(tokens), 2, stream=True)
    if name == "big":
        return _repeat(lambda: _big_body(tokens), 1)
    if name == "prompt-logprobs":
        return _repeat(_prompt_logprobs_body, 2)
    if name == "logit-bias":
        return _repeat(_logit_bias_body, 4)
    return _sse_readers


def _line(row: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    ratio = row.get("ratio_to_idle")
    return (f"{row['attack']:>16}: gap p50 {ms(row['gap_p50_ms'])}, p90 {ms(row['gap_p90_ms'])}"
            f"{'' if ratio is None else f', {ratio:.2f}x idle'} ({row['gaps']} gaps); tiny request "
            f"{row['tiny_status']} in {row['tiny_s']:.2f} s; attack answers {row['attack_statuses']}")
