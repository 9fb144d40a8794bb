"""Locust users that stream speech and measure what a listener feels.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000      (or: scripts/loadtest)

Each user streams from ``POST /v1/audio/speech`` (OpenAI, ``pcm``) and ``POST /v1/speech/stream``
(native, ``wav`` at 16 kHz, ``read``; ``chat`` too when the engine lists it in ``/v1/voices``
``modes``, else that task reads). Per request Locust records, under the route's name:

- request type ``POST``: the whole stream (headers to last byte) and its size; a body cut short,
  a non-200 status or an empty audio stream is a failure;
- ``TTFB``: time to the first body byte, in ms;
- ``AUDIO``: audio received, in ms of audio (counted from the bytes: pcm size, or wav data after
  its header);
- ``RTF``: real-time factor (stream time / audio time) x 1000, so 250 means 0.25.

Locust's tables show all four in their "ms" columns. With ``LOADTEST_RECORDS=path`` every request
is also appended to a JSON-lines file (what ``scripts/loadtest`` turns into its summary and plot),
including streams still open when the run ended (``ok: null``; Locust itself drops those).

``ScheduledListener`` (``locust ... ScheduledListener``, used by ``scripts/bench_serve``) replays
a fixed arrival schedule instead: ``LOADTEST_SCHEDULE`` names a JSON file ``{"t0": epoch s,
"route": ..., "body": {...}, "format": ..., "sample_rate": ..., "arrivals_s": [...]}``; user i
starts its one stream at ``t0 + arrivals_s[i]`` and stops, and the run quits after the last one.
A body with ``"stream_format": "sse"`` is read as OpenAI's speech events
(``loadtest/sse_audio.py``): TTFB is the time to the first event with audio, the audio is the
events' (base64-decoded), an ``error`` event or a body without ``speech.audio.done`` is a
failure, and the record counts the ``words`` the events carried (word timestamps).

Every record says whether the stream was real-time: a player that starts at the first byte
never runs dry (each piece arrives before the audio already received has played out).

Environment knobs: ``LOADTEST_API_KEY`` (Bearer key), ``LOADTEST_MIX`` (text lengths, e.g.
``short=5,medium=3,long=1``), ``LOADTEST_WEIGHTS`` (tasks, e.g. ``openai=3,read=2,chat=1``),
``LOADTEST_WAIT_S`` (think time ``min,max`` seconds, default ``0.5,2``), ``LOADTEST_SHAPE``
(``constant``, ``ramp`` or ``steps``; unset: Locust's own ``-u``/``-r``/``-t``) with
``LOADTEST_RUN_TIME_S``, ``LOADTEST_RAMP_S``, ``LOADTEST_STEP_S`` and ``LOADTEST_STEP_USERS``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import gevent
from gevent import GreenletExit
from locust import HttpUser, LoadTestShape, between, events, task
from locust.exception import StopUser
from requests.exceptions import RequestException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # locust imports us by path

from loadtest.audio_bytes import AudioCounter
from loadtest.corpus import CHAT, parse_mix, pick
from loadtest.sse_audio import SseAudio

logger = logging.getLogger(__name__)

OPENAI_ROUTE = "/v1/audio/speech"
NATIVE_ROUTE = "/v1/speech/stream"
OPENAI_PCM_RATE_HZ = 24000
NATIVE_RATE_HZ = 16000


def _weights(spec: str | None) -> dict[str, int]:
    weights = {"openai": 3, "read": 2, "chat": 1}
    for part in filter(None, (spec or "").split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in weights:
            raise ValueError(f"LOADTEST_WEIGHTS: unknown task {name!r}; known: openai, read, chat")
        weights[name.strip()] = int(value)
    return weights


def _wait_range(spec: str | None) -> tuple[float, float]:
    low, _, high = (spec or "0.5,2").partition(",")
    return float(low), float(high or low)


WEIGHTS = _weights(os.environ.get("LOADTEST_WEIGHTS"))
MIX = parse_mix(os.environ.get("LOADTEST_MIX"))


class _Records:
    """Appends one JSON line per finished request to ``LOADTEST_RECORDS`` (if set)."""

    def __init__(self, path: str | None) -> None:
        # Line-buffered and open for the whole run: each record is on disk as it is written.
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")


RECORDS = _Records(os.environ.get("LOADTEST_RECORDS"))


class _Listener(HttpUser):
    """Streams speech and records what a listener feels (the tasks are the subclasses')."""

    abstract = True

    def on_start(self) -> None:
        api_key = os.environ.get("LOADTEST_API_KEY")
        if api_key:
            self.client.headers["authorization"] = f"Bearer {api_key}"

    def _stream(self, path: str, body: dict[str, Any], name: str, length: str,
                audio: AudioCounter, events: SseAudio | None = None) -> None:
        """One stream to its end; with ``events``, the body is server-sent events and the
        audio is theirs."""
        started_at = time.time()
        started = time.perf_counter()
        request_id = uuid.uuid4().hex  # the service logs it at every hop
        ttfb_s: float | None = None
        last_piece: float | None = None
        longest_gap_s = 0.0  # the longest wait between two pieces of audio (spikes)
        ran_dry = False
        refused = False  # a 503 or 429 with Retry-After: the service said "not now", at once
        error: str | None = None
        status = None
        try:
            with self.client.post(path, json=body, name=name, stream=True,
                                  headers={"x-request-id": request_id},
                                  catch_response=True) as response:
                status = response.status_code
                if response.status_code != 200:
                    detail = (response.text[:200] if response.status_code
                              else repr(response.error))
                    error = f"HTTP {response.status_code}: {detail}"
                    refused = (response.status_code in (429, 503)
                               and "Retry-After" in response.headers)
                else:
                    try:
                        for piece in response.iter_content(chunk_size=None):
                            if events is not None:
                                piece = events.audio_of(piece)
                            if piece:
                                now = time.perf_counter()
                                if ttfb_s is None:
                                    ttfb_s = now - started
                                elif now - started - ttfb_s > audio.audio_s + 1e-3:
                                    ran_dry = True
                                if last_piece is not None:
                                    longest_gap_s = max(longest_gap_s, now - last_piece)
                                last_piece = now
                                audio.feed(piece)
                    except (RequestException, ValueError) as exc:
                        error = (f"stream broken after {audio.body_bytes} bytes: "
                                 f"{type(exc).__name__}")
                    if error is None and events is not None:
                        error = events.failure()
                    if error is None and audio.audio_s <= 0:
                        error = "stream ended without audio"
                total_s = time.perf_counter() - started
                response.request_meta["response_time"] = total_s * 1000
                response.request_meta["response_length"] = audio.body_bytes
                if error is None:
                    response.success()
                else:
                    response.failure(error)
        except GreenletExit:
            # The run ended (past --stop-timeout) with this stream open: neither success nor
            # failure, and Locust drops it too; the records keep it as unfinished.
            self._record(started_at, name, length, None, status, ttfb_s,
                         time.perf_counter() - started, audio, "unfinished when the run ended",
                         realtime=False, request_id=request_id, longest_gap_s=longest_gap_s,
                         words=events.words if events is not None else None)
            raise
        if error is None:
            self._fire("TTFB", name, ttfb_s * 1000)
            self._fire("AUDIO", name, audio.audio_s * 1000)
            self._fire("RTF", name, total_s / audio.audio_s * 1000)
        self._record(started_at, name, length, error is None, status, ttfb_s, total_s, audio,
                     error, realtime=error is None and not ran_dry, request_id=request_id,
                     longest_gap_s=longest_gap_s,
                     words=events.words if events is not None else None, refused=refused)

    def _record(self, started_at: float, name: str, length: str, ok: bool | None,
                status: int | None, ttfb_s: float | None, total_s: float, audio: AudioCounter,
                error: str | None, realtime: bool, request_id: str | None = None,
                longest_gap_s: float | None = None, words: int | None = None,
                refused: bool = False) -> None:
        runner = self.environment.runner
        RECORDS.write({
            "request_id": request_id, "start": started_at, "route": name, "length": length, "ok": ok, "status": status,
            "ttfb_s": ttfb_s, "total_s": total_s, "audio_s": audio.audio_s,
            "bytes": audio.body_bytes, "error": error, "realtime": realtime,
            "longest_gap_s": longest_gap_s, "words": words, "refused": refused,
            "users": runner.user_count if runner else None,
        })

    def _fire(self, metric: str, name: str, value: float) -> None:
        self.environment.events.request.fire(request_type=metric, name=name,
                                             response_time=value, response_length=0,
                                             exception=None, context={})


class SpeechUser(_Listener):
    """A listener: picks a text, streams its speech to the end, pauses, repeats."""

    wait_time = between(*_wait_range(os.environ.get("LOADTEST_WAIT_S")))
    _modes: ClassVar[tuple[str, ...] | None] = None  # the engine's modes, probed once

    def on_start(self) -> None:
        super().on_start()
        self.rng = random.Random()
        if SpeechUser._modes is None:
            SpeechUser._modes = self._probe_modes()

    def _probe_modes(self) -> tuple[str, ...]:
        with self.client.get("/v1/voices", name="/v1/voices (probe)",
                             catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
                return ("read",)
            modes = tuple(response.json().get("modes", ["read"]))
        logger.info("engine modes: %s", ", ".join(modes))
        return modes

    @task(WEIGHTS["openai"])
    def openai_speech(self) -> None:
        length, text = pick(MIX, self.rng)
        body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}
        self._stream(OPENAI_ROUTE, body, OPENAI_ROUTE, length,
                     AudioCounter("pcm", OPENAI_PCM_RATE_HZ))

    @task(WEIGHTS["read"])
    def native_read(self) -> None:
        length, text = pick(MIX, self.rng)
        body = {"text": text, "mode": "read", "format": "wav", "sample_rate": NATIVE_RATE_HZ}
        self._stream(NATIVE_ROUTE, body, f"{NATIVE_ROUTE} read", length,
                     AudioCounter("wav", NATIVE_RATE_HZ))

    @task(WEIGHTS["chat"])
    def native_chat(self) -> None:
        if "chat" not in (SpeechUser._modes or ()):
            self.native_read()
            return
        body = {"text": self.rng.choice(CHAT), "mode": "chat", "format": "wav",
                "sample_rate": NATIVE_RATE_HZ}
        self._stream(NATIVE_ROUTE, body, f"{NATIVE_ROUTE} chat", "chat",
                     AudioCounter("wav", NATIVE_RATE_HZ))


class ScheduledListener(_Listener):
    """One stream per user at a fixed time (``LOADTEST_SCHEDULE``); the run ends after the last.

    Start as many users as the schedule has arrivals, all at once (``-u N -r N``).
    """

    abstract = "LOADTEST_SCHEDULE" not in os.environ
    wait_time = between(0, 0)
    _schedule: ClassVar[dict[str, Any] | None] = None
    _claimed: ClassVar[int] = 0
    _finished: ClassVar[int] = 0

    @classmethod
    def schedule(cls) -> dict[str, Any]:
        if cls._schedule is None:
            cls._schedule = json.loads(Path(os.environ["LOADTEST_SCHEDULE"]).read_text())
        return cls._schedule

    def scheduled_stream(self) -> None:
        plan = ScheduledListener.schedule()
        arrivals = plan["arrivals_s"]
        index = ScheduledListener._claimed
        ScheduledListener._claimed += 1
        if index >= len(arrivals):
            raise StopUser()
        gevent.sleep(max(0.0, plan["t0"] + arrivals[index] - time.time()))
        body = plan["body"]
        if plan.get("voices"):  # spread over registered voices, round-robin
            body = {**body, "voice": plan["voices"][index % len(plan["voices"])]}
        events = SseAudio() if body.get("stream_format") == "sse" else None
        try:
            self._stream(plan["route"], body, plan["name"], plan["name"],
                         AudioCounter(plan["format"], plan["sample_rate"]), events)
        finally:
            ScheduledListener._finished += 1
            if ScheduledListener._finished == len(arrivals):
                # Quit from another greenlet: quitting stops this one too.
                gevent.spawn_later(0.5, self.environment.runner.quit)
        raise StopUser()

    tasks = [scheduled_stream]


class _ShapeBase(LoadTestShape):
    """Users and spawn rate come from Locust's ``-u`` and ``-r``; the run time from
    ``LOADTEST_RUN_TIME_S`` or ``-t``, timed by the shape itself: Locust's ``-t`` timer runs on
    gevent's cached clock and can fire seconds early after a slow start-up."""

    abstract = True
    use_common_options = True

    def _options(self) -> tuple[int, float, float]:
        options = self.runner.environment.parsed_options
        users = int(options.num_users or 1)
        spawn_rate = float(options.spawn_rate or users)
        run_time_s = float(os.environ.get("LOADTEST_RUN_TIME_S") or options.run_time or math.inf)
        return users, spawn_rate, run_time_s


class ConstantShape(_ShapeBase):
    """``LOADTEST_SHAPE=constant``: ``-u`` users started at ``-r`` per second, until the end."""

    abstract = os.environ.get("LOADTEST_SHAPE") != "constant"

    def tick(self) -> tuple[int, float] | None:
        users, spawn_rate, run_time_s = self._options()
        return None if self.get_run_time() >= run_time_s else (users, spawn_rate)


class RampShape(_ShapeBase):
    """``LOADTEST_SHAPE=ramp``: linear ramp from 1 to ``-u`` users over ``LOADTEST_RAMP_S``
    seconds (default: half the run), then hold until the run time ends."""

    abstract = os.environ.get("LOADTEST_SHAPE") != "ramp"

    def tick(self) -> tuple[int, float] | None:
        users, _, run_time_s = self._options()
        now = self.get_run_time()
        if now >= run_time_s:
            return None
        ramp_s = float(os.environ.get("LOADTEST_RAMP_S") or
                       (run_time_s / 2 if math.isfinite(run_time_s) else 60))
        target = users if now >= ramp_s else 1 + int((users - 1) * now / ramp_s)
        return target, max(1.0, users / max(ramp_s, 1.0))


class StepShape(_ShapeBase):
    """``LOADTEST_SHAPE=steps``: add ``LOADTEST_STEP_USERS`` users (default a quarter of ``-u``)
    every ``LOADTEST_STEP_S`` seconds (default a quarter of the run) up to ``-u``."""

    abstract = os.environ.get("LOADTEST_SHAPE") != "steps"

    def tick(self) -> tuple[int, float] | None:
        users, spawn_rate, run_time_s = self._options()
        now = self.get_run_time()
        if now >= run_time_s:
            return None
        step_users = int(os.environ.get("LOADTEST_STEP_USERS") or max(1, users // 4))
        step_s = float(os.environ.get("LOADTEST_STEP_S") or
                       (run_time_s / 4 if math.isfinite(run_time_s) else 30))
        target = min(users, step_users * (1 + int(now // step_s)))
        return target, spawn_rate


if os.environ.get("LOADTEST_SHAPE") not in (None, "", "constant", "ramp", "steps"):
    raise ValueError("LOADTEST_SHAPE must be constant, ramp or steps, not "
                     f"{os.environ['LOADTEST_SHAPE']!r}")


@events.test_start.add_listener
def _announce(environment: Any, **_: Any) -> None:
    logger.info("load test on %s: tasks %s, text mix %s, shape %s", environment.host, WEIGHTS,
                MIX, os.environ.get("LOADTEST_SHAPE") or "constant")
