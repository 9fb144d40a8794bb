"""The messages ``WS /v1/audio/speech/stream`` is sent by :class:`SpeechStreamTTSService`, and its
opening handshake: plain ``websockets`` and JSON, no Pipecat."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

# The most text one input_text.delta may carry (the service's api.max_text_delta_chars default).
MAX_DELTA_CHARS = 1000
# How long a new session may take to answer session.start (the service opens its stream first).
SESSION_START_TIMEOUT_S = 60.0
INPUT_TEXT_DONE = json.dumps({"type": "input_text.done"})


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer``, where the service has keys."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def start_session(websocket, voice: str, sample_rate: int) -> None:
    """``session.start`` (PCM with word timestamps) until ``session.started``; a refusal raises
    ``ConnectionError``."""
    await websocket.send(json.dumps({
        "type": "session.start", "voice": voice,
        "response_format": "pcm", "sample_rate": sample_rate,
        "timestamp_granularities": ["word"]}))
    reply = json.loads(await asyncio.wait_for(websocket.recv(), SESSION_START_TIMEOUT_S))
    if reply.get("type") != "session.started":
        raise ConnectionError(f"session refused: {reply.get('error', reply)}")


def text_deltas(text: str) -> Iterator[str]:
    """``text`` as ``input_text.delta`` messages, each within the service's limit."""
    for start in range(0, len(text), MAX_DELTA_CHARS):
        delta = text[start:start + MAX_DELTA_CHARS]
        yield json.dumps({"type": "input_text.delta", "delta": delta})


def cancel(played_s: float) -> str:
    """``cancel``: stop synthesizing; ``played_s`` seconds of the audio were heard."""
    return json.dumps({"type": "cancel", "played_s": round(played_s, 3)})
