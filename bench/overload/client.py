"""The overload benchmark's listeners: each offered stream on the native route (pcm), read as
it comes, from several processes (one event loop cannot read a thousand streams' bytes and
keep time), each stream recorded as a :class:`~bench.overload.levels.StreamFate`.

A WebSocket session (``kind`` "session") is ``session.start``, the text in a few deltas with
pauses, ``input_text.done``: refused if ``session.start`` is answered with an error, lost if
it was accepted and then ended without ``response.done``.

Each stream sends a request id of its own (``x-request-id``, kept on its fate), which Serve
makes the id of its call to the Synthesizer: a fleet run traces it to its replica.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
import uuid
from typing import Any

import aiohttp

from bench.overload.levels import StreamFate
from bench.served.arrivals import CHAT_TEXT, NATIVE_ROUTE, READ_TEXT
from harness.stream_clients import PCM_BYTES_PER_S

SOCKET_ROUTE = "/v1/audio/speech/stream"
GIVE_UP_S = 300.0


async def _http_stream(session: aiohttp.ClientSession, base_url: str, fate: StreamFate,
                       started: float, headers: dict[str, str]) -> None:
    body = {"text": CHAT_TEXT if fate.kind == "chat" else READ_TEXT, "mode": fate.kind,
            "format": "pcm"}
    async with session.post(base_url + NATIVE_ROUTE, json=body, headers=headers) as response:
        fate.status = response.status
        fate.answered_s = time.perf_counter() - started
        fate.retry_after = "Retry-After" in response.headers
        if response.status != 200:
            fate.error = f"HTTP {response.status}: {(await response.text())[:120]}"
            return
        odd = b""
        async for piece in response.content.iter_any():
            piece = odd + piece
            usable = len(piece) - len(piece) % 2
            odd = piece[usable:]
            fate.audio(time.perf_counter() - started, usable / PCM_BYTES_PER_S)
        fate.whole = True  # aiohttp raises on a chunked body cut before its last chunk


async def _session(session: aiohttp.ClientSession, base_url: str, fate: StreamFate,
                   started: float, headers: dict[str, str]) -> None:
    url = base_url.replace("http://", "ws://") + SOCKET_ROUTE
    async with session.ws_connect(url, headers=headers, max_msg_size=0) as ws:
        await ws.send_json({"type": "session.start", "response_format": "pcm",
                            "sample_rate": 24000})
        first = await ws.receive_json()
        fate.answered_s = time.perf_counter() - started
        if first.get("type") != "session.started":
            error = first.get("error", {})
            fate.status = {"overloaded": 503, "rate_limit_error": 429}.get(
                error.get("code") if error.get("code") == "overloaded" else error.get("type"))
            fate.retry_after = error.get("retry_after_s") is not None
            fate.error = f"{error.get('code')}: {error.get('message', '')[:100]}"
            return
        fate.status = 200
        words = READ_TEXT.split(" ")
        for start in range(0, len(words), 8):  # an LLM's answer: a few words at a time
            await ws.send_json({"type": "input_text.delta",
                                "delta": " ".join(words[start:start + 8]) + " "})
            await asyncio.sleep(0.2)
        await ws.send_json({"type": "input_text.done"})
        async for message in ws:
            if message.type == aiohttp.WSMsgType.BINARY:
                fate.audio(time.perf_counter() - started, len(message.data) / PCM_BYTES_PER_S)
                continue
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            event = json.loads(message.data)
            if event.get("type") == "response.done":
                fate.whole = True
                return
            if event.get("type") == "error":
                fate.error = f"error event after start: {event.get('error', {}).get('code')}"
                return


async def _one(session: aiohttp.ClientSession, base_url: str, at_s: float, kind: str,
               t0: float, headers: dict[str, str]) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    fate = StreamFate(kind=kind, at_s=at_s, request_id=uuid.uuid4().hex)
    headers = {**headers, "x-request-id": fate.request_id}
    started = time.perf_counter()
    run = _session if kind == "session" else _http_stream
    try:
        await asyncio.wait_for(run(session, base_url, fate, started, headers), GIVE_UP_S)
    except Exception as exc:  # a cut body, a reset connection, a stream that never ended
        fate.error = (f"{type(exc).__name__} after {time.perf_counter() - started:.1f} s: "
                      f"{str(exc)[:100]}")
    return fate.as_dict()


async def _listen(base_url: str, schedule: list[tuple[float, str]], t0: float,
                  headers: dict[str, str]) -> list[dict[str, Any]]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(_one(session, base_url, at, kind, t0, headers)
                                           for at, kind in schedule)))


def _process(job: tuple[str, list[tuple[float, str]], float, dict[str, str]]
             ) -> list[dict[str, Any]]:
    base_url, schedule, t0, headers = job
    return asyncio.run(_listen(base_url, schedule, t0, headers))


def offer(base_url: str, schedule: list[tuple[float, str]], processes: int = 8,
          headers: dict[str, str] | None = None, lead_s: float = 1.0) -> list[StreamFate]:
    """Play ``schedule`` (seconds from now + ``lead_s``, kind) against the service from
    ``processes`` processes; every stream's fate, in arrival order."""
    processes = max(1, min(processes, len(schedule)))
    t0 = time.perf_counter() + lead_s  # perf_counter is one clock across processes on Linux
    jobs = [(base_url, schedule[i::processes], t0, headers or {}) for i in range(processes)]
    if processes == 1:
        results = [_process(jobs[0])]
    else:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = pool.map(_process, jobs)
    fates = [StreamFate(**record) for part in results for record in part]
    return sorted(fates, key=lambda fate: fate.at_s)
