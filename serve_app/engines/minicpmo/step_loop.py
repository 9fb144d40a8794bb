"""The engine's step thread: every step admits, runs and emits for all streams together.

1. admit: end aborted streams; give queued ones slots; one batched LLM prefill gives each its
   speaker embedding (chat streams keep their prompt in an LLM slot and sample a first token);
2. run: chat streams decode text (3 tokens per piece); each stream's
   :class:`~.speech_schedule.SpeechSchedule` turns its pieces into work; batched TTS text
   prefills, then one batched window of audio steps for every generating stream;
3. emit: batched DVAE + Vocos decode of the generate calls that ended is queued on the device;
   the next step hands its audio out (what can no longer change goes to its caller at once)
   while the device runs that step's audio window.

The device's work is queued, not waited for, wherever the host has other work: the host
prepares step k+1 while the device decodes step k's audio, and joins and sends step k's audio
while the device runs step k+1's window (copies between them never make the host wait:
transfer.py). The host waits only for the tokens and frames it must read to go on.
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..base import EngineError, Outbox, RequestAbortedError
from ..faults import FaultInjection, crash_process
from .chat import ChatText
from .device.audio_step import AudioStepInputs
from .device.runner import DecodedAudio, ModelRunner, pass_fits
from .device.transfer import HostCopy
from .joiner import StreamingAudioJoiner
from .model.codec import SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from .model.loader import LoadedModel
from .options import EngineOptions
from .output import emit, join_decoded, send
from .scheduler import Scheduler, Stream
from .speech_schedule import CarryPrefill, DecodeJob, Phase, SpeechSchedule, TextPrefill
from .voices import VoiceTable, prefix_length

logger = logging.getLogger(__name__)

STEP_LOG_LENGTH = 100_000  # steps kept in the step log (a few minutes of a busy engine)


@dataclass(slots=True)
class PendingDecode:
    """A step's decode, queued on the device; the next step hands its audio out."""

    jobs: list[tuple[Stream, DecodeJob]]  # every decode job of the step, empty ones included
    decoded: list[tuple[Stream, DecodeJob]]  # the jobs with frames, in ``audio``'s order
    audio: DecodedAudio | None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, for benchmarks that ask what a tail latency is made of."""

    started_s: float  # time.perf_counter() when the step began
    seconds: float  # how long it ran
    generating: int  # streams that got audio frames in it
    queue_waits_s: tuple[float, ...]  # each stream admitted in it: submission to admission
    gc_s: float = 0.0  # spent in Python's garbage collector during it (any thread's collection)
    # seconds of the step in each phase (host time; device time too with ``profile_phases``,
    # which syncs the GPU at each phase's end), and what the device was asked to do in it
    # (``ModelRunner.work`` counted over the step): what a slow step was slow at
    phases_s: tuple[tuple[str, float], ...] = ()
    work: tuple[tuple[str, int], ...] = ()


class GarbageCollectionClock:
    """Seconds Python's cyclic garbage collector has run, from ``gc.callbacks`` (a collection
    stops every thread: a long one is a step's spike)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


class StepLoop:
    """Owns the step thread; the only code that touches running streams and the runner."""

    def __init__(self, model: LoadedModel, options: EngineOptions, scheduler: Scheduler,
                 runner: ModelRunner, chat: ChatText, spk_id: int, gen_prompt_ids: list[int],
                 voices: VoiceTable) -> None:
        self.model = model
        self.options = options
        self.scheduler = scheduler
        self.voices = voices
        self.runner = runner
        self.chat = chat
        self._spk_id = spk_id
        self._gen_prompt_ids = gen_prompt_ids
        self._stts_id = model.tts_tokenizer.convert_tokens_to_ids("[Stts]")
        self._traces: dict[str, SpeechSchedule] = {}
        self._phase_s: dict[str, float] = collections.defaultdict(float)
        self._faults = FaultInjection.from_options(options.fault_injection)
        self._step_counter = itertools.count()
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_LENGTH)
        self._step_admitted: list[Stream] = []
        self._step_phases: dict[str, float] = collections.defaultdict(float)
        self._gc_clock = GarbageCollectionClock()
        self._step_generating = 0
        self._outbox = Outbox()  # this step's chunks and errors, delivered when it ends
        self._pending_decode: PendingDecode | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="minicpmo-engine", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._gc_clock.close()

    def trace(self, request_id: str) -> SpeechSchedule | None:
        return self._traces.get(request_id)

    def phase_seconds(self) -> dict[str, float]:
        return dict(self._phase_s)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            if self.scheduler.idle():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            started_s = time.perf_counter()
            gc_before_s = self._gc_clock.total_s
            work_before = dict(self.runner.work)
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as error:  # one bad step must not kill the loop; fail its streams
                logger.exception("engine step failed")
                self._pending_decode = None
                for stream in self.scheduler.running():
                    self._fail(stream, EngineError(f"engine step failed: {type(error).__name__}"))
            # logged before the step's batched deliveries (the engine process's wire); a
            # per-item sink (an event loop in this process) has had each item at once, so its
            # caller may hold a step's last chunk a moment before the step is logged
            self.step_log.append(StepRecord(
                started_s, time.perf_counter() - started_s, self._step_generating,
                tuple(s.admitted_at - s.submitted_at for s in self._step_admitted),
                self._gc_clock.total_s - gc_before_s, tuple(self._step_phases.items()),
                tuple((kind, count - work_before.get(kind, 0))
                      for kind, count in self.runner.work.items()
                      if count != work_before.get(kind, 0))))
            self._step_admitted, self._step_generating = [], 0
            self._step_phases = collections.defaultdict(float)
            self._outbox.deliver()
            self.scheduler.count_step_time(time.perf_counter() - started_s)

    def _phase(self, name: str, started: float) -> float:
        """Account the time since ``started`` to phase ``name`` in this step's record, and in
        the running totals when profiling (which synchronises the GPU first, so that the
        phase's device work is counted in it rather than in the next phase that waits)."""
        profiling = self.options.profile_phases
        if profiling and self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._step_phases[name] += now - started
        if profiling:
            self._phase_s[name] += now - started
        return now

    def _step(self) -> None:
        t = time.perf_counter()
        self._end_aborted()
        if self._faults is not None:
            self._inject_faults()
        self._admit(next(self._step_counter))
        t = self._phase("admit_prefill", t)
        launched = self._launch_chat_text()
        if launched is None:
            self._decode_chat_text()
        t = self._phase("llm_decode", t)
        self._take_fed_text()
        prefills = [work for stream in self.scheduler.running() for work in self._read_text(stream)]
        t = self._phase("schedule", t)
        self._run_tts_prefills(prefills)
        t = self._phase("tts_prefill", t)
        generating = [s for s in self.scheduler.running()
                      if s.schedule is not None and s.schedule.phase is Phase.GENERATING]
        window = self._launch_audio_window(generating) if generating else None
        t = self._phase("tts_step", t)
        self._emit_decoded()  # the last step's audio, while the device runs this window
        t = self._phase("decode_emit", t)
        if launched is not None and self._waiting_for_text(launched[0]):
            self._chat_text_beside_window(*launched)
            launched = None
            t = self._phase("llm_decode", t)
        decode_jobs, follow_up = self._take_frames(generating, window) if generating else ([], [])
        t = self._phase("tts_step", t)
        self._run_tts_prefills(follow_up)
        t = self._phase("tts_prefill", t)
        self._launch_decode(decode_jobs)
        t = self._phase("decode_emit", t)
        if launched is not None:
            self._collect_chat_text(*launched)
            self._phase("llm_decode", t)
        self.scheduler.count_step(len(generating))
        self._step_generating = len(generating)

    # ---- admission -------------------------------------------------------------------------

    def _admit(self, step: int) -> None:
        """Admit queued streams while their prompts fit one prefill pass of
        ``options.prefill_tokens`` padded tokens and ``options.prefill_prompts`` prompts (the
        first always does), and prefill them: a larger admission spreads over the next steps
        instead of stalling this one, as vLLM's token budget per step does."""
        prompts: list[list[int]] = []
        longest = 0  # of prompts: the pass is len(prompts) x longest tokens

        def fits(stream: Stream) -> bool:
            nonlocal longest
            ids = self._prompt_ids(stream)
            if len(prompts) >= self.options.prefill_prompts or not pass_fits(
                    len(prompts) + 1, max(longest, len(ids)), self.options.prefill_tokens):
                return False
            prompts.append(ids)
            longest = max(longest, len(ids))
            return True

        admitted = self.scheduler.admit(step, fits)
        if not admitted:
            return
        now = time.perf_counter()
        for stream in admitted:
            stream.admitted_at = now
        self._step_admitted = admitted
        for stream in admitted:
            self.runner.clear_tts_slot(stream.slot)
        try:
            self._prefill_pass(admitted, prompts)
        except Exception as error:
            logger.exception("prefill failed")
            for stream in admitted:
                self._fail(stream, EngineError(f"prefill failed: {type(error).__name__}"))
            return
        for stream in admitted:
            self._init_schedule(stream)

    def _prompt_ids(self, stream: Stream) -> list[int]:
        """The LLM prompt a stream prefills (tokenized when it was submitted; a stream in a
        cloned voice only its own turn, after its voice turn's cached keys)."""
        return stream.plan.prompt_ids + self._gen_prompt_ids

    def _prefill_pass(self, streams: list[Stream], prompts: list[list[int]]) -> None:
        """One LLM prefill of the admitted streams' prompts."""
        chat_rows = [i for i, s in enumerate(streams) if s.plan.is_chat]
        logits = self.runner.prefill_prompts(prompts, [s.voice for s in streams],
                                             [s.slot for s in streams], self._spk_id, chat_rows,
                                             [streams[i].llm_slot for i in chat_rows])
        if logits is None:
            return
        chat_streams = [streams[i] for i in chat_rows]
        for i, stream in zip(chat_rows, chat_streams):
            self.chat.start(stream, prefix_length(stream.voice) + len(prompts[i]))
        tokens = self.runner.sample_first_tokens(logits, self.chat.inputs(chat_streams))
        for stream, token in zip(chat_streams, tokens):
            self._accept_token(stream, token)

    def _init_schedule(self, stream: Stream) -> None:
        request = stream.plan.request
        lengths = request.lengths
        frame_limit = lengths.audio_frames
        if request.max_audio_s is not None:
            cap = int(request.max_audio_s * SAMPLE_RATE_HZ / SAMPLES_PER_CODE_FRAME)
            frame_limit = cap if frame_limit is None else min(frame_limit, cap)
        tokenizer = self.model.tts_tokenizer
        stream.schedule = SpeechSchedule(
            config=self.model.config.tts,
            tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
            decode_tokens=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
            chunk_frames=self.options.chunk_frames,
            max_segment_frames=self.options.max_segment_frames,
            max_positions=self.options.tts_max_positions,
            ignore_eos=lengths.ignore_eos or lengths.audio_frames is not None,
            total_frame_limit=frame_limit,
            stts_id=self._stts_id)
        stream.joiner = StreamingAudioJoiner()
        if not stream.plan.is_chat:
            stream.pieces.extend(stream.plan.pieces)
            stream.text_done = stream.plan.text_feed is None
            stream.text_at = time.monotonic()

    # ---- run ---------------------------------------------------------------------------------

    def _chat_text_rows(self) -> list[Stream]:
        """Chat streams that want their next LLM token: text not done, below the lookahead."""
        return [s for s in self.scheduler.running()
                if s.plan.is_chat and not s.text_done and s.llm_slot >= 0
                and s.schedule is not None and len(s.pieces) < self.options.llm_lookahead_pieces]

    def _launch_chat_text(self) -> tuple[list[Stream], object] | None:
        """With ``overlap_llm_step``, when audio is generated this step: one LLM step launched
        now, beside the audio window, and collected after it (:meth:`_collect_chat_text`), or,
        while a chat stream's speech waits for text, right after the window is queued, with
        more steps beside the window (:meth:`_chat_text_beside_window`)."""
        if not self.options.overlap_llm_step:
            return None
        streams = self._chat_text_rows()
        if not streams:
            return None
        if not any(s.schedule is not None and s.schedule.phase is Phase.GENERATING
                   for s in self.scheduler.running()):
            return None
        launched = self.runner.llm_launch([s.llm_slot for s in streams], self.chat.inputs(streams))
        return streams, launched

    def _collect_chat_text(self, streams: list[Stream], launched: object) -> None:
        self._take_tokens(streams, self.runner.llm_collect(launched))

    @staticmethod
    def _waiting_for_text(streams: list[Stream]) -> bool:
        """Some stream's speech waits for its next piece of text."""
        return any(not s.pieces and not s.text_done and s.schedule.phase is Phase.WAITING_TEXT
                   for s in streams)

    def _chat_text_beside_window(self, streams: list[Stream], launched: object) -> None:
        """The launched LLM step's tokens, then, while a stream's speech waits for text, more
        steps (up to ``steps_per_sync`` in all), each launched beside the audio window queued
        last: the running streams' audio is not held up by text that only the waiting streams
        need now (their pieces are read next step)."""
        self._collect_chat_text(streams, launched)
        for _ in range(self.options.steps_per_sync - 1):
            streams = self._chat_text_rows()
            if not streams or not self._waiting_for_text(streams):
                return
            self._collect_chat_text(streams, self.runner.llm_launch(
                [s.llm_slot for s in streams], self.chat.inputs(streams), beside_window=True))

    def _take_tokens(self, streams: list[Stream], tokens: list[int]) -> None:
        """One LLM step's tokens into its streams (one whose LLM slot was freed since, when the
        step was launched earlier in the engine step, takes none)."""
        self.scheduler.count(llm_steps=1)
        for stream, token in zip(streams, tokens):
            stream.llm_len += 1
            if stream.llm_slot >= 0:
                self._accept_token(stream, token)

    def _decode_chat_text(self) -> None:
        """One batched LLM step for every chat stream below its lookahead; more steps (up to
        ``steps_per_sync``) while a stream's speech waits for its next piece."""
        for _ in range(self.options.steps_per_sync):
            streams = self._chat_text_rows()
            if not streams:
                return
            self._take_tokens(streams, self.runner.llm_step([s.llm_slot for s in streams],
                                                            self.chat.inputs(streams)))
            if not self._waiting_for_text(streams):
                return

    def _accept_token(self, stream: Stream, token: int) -> None:
        if self.chat.accept(stream, token):
            self.scheduler.free_llm_slot(stream)

    def _take_fed_text(self) -> None:
        """Cut the text fed to streamed requests into pieces for their schedules; a stream
        whose input ended with nothing speakable ends without audio."""
        for stream in self.scheduler.running():
            feed = stream.plan.text_feed
            if feed is None or stream.text_done or stream.schedule is None:
                continue
            text, done = self.scheduler.take_fed_text(stream)
            if text:
                stream.text_at = time.monotonic()
            stream.pieces.extend(feed.push(text))
            if done:
                stream.pieces.extend(feed.finish())
                stream.text_done = True
                if not feed.speakable:
                    self._complete(stream)

    def _read_text(self, stream: Stream) -> list[tuple[Stream, object]]:
        """Feed the stream's waiting pieces to its schedule; the TTS work that results."""
        schedule = stream.schedule
        work: list[tuple[Stream, object]] = []
        while schedule is not None and schedule.phase is Phase.WAITING_TEXT:
            if stream.pieces:
                items = schedule.accept_piece(stream.pieces.popleft())
            elif stream.text_done:
                items = schedule.end_of_text()
            else:
                items = self._cut_stopped_text(stream)
                if not items:
                    break
            work.extend((stream, item) for item in items)
        return work

    def _cut_stopped_text(self, stream: Stream) -> list[object]:
        """Streamed text that has stopped coming (nothing for ``text_break_wait_s``) while the
        speech waits for more: speak it up to its last break now (``streamed_text``'s rule),
        rather than when ten more TTS tokens or the end of the input arrive. Not for a stream
        of fixed length, whose segments never end on their own."""
        feed, schedule = stream.plan.text_feed, stream.schedule
        if (feed is None or schedule.ignore_eos or stream.break_checked == feed.version
                or time.monotonic() - stream.text_at < self.options.text_break_wait_s):
            return []
        stream.break_checked = feed.version  # looked at: again only once more text came
        point = feed.break_point()
        work = schedule.cut_at_break(*point) if point is not None else None
        if work is None:
            return []
        feed.cut_at_break()
        return work

    def _run_tts_prefills(self, work: list[tuple[Stream, object]]) -> None:
        texts: list[tuple[int, TextPrefill]] = []
        for stream, item in work:
            if stream.done or stream.slot < 0:
                continue
            if item == "reset_cache":
                self.runner.clear_tts_slot(stream.slot)
            elif isinstance(item, TextPrefill):
                texts.append((stream.slot, item))
            elif isinstance(item, CarryPrefill):
                if texts:
                    self.runner.text_prefill(texts)
                    texts = []
                self.runner.carry_prefill(stream.slot, item.frames, len(stream.schedule.text_ids))
        if texts:
            self.runner.text_prefill(texts)

    def _launch_audio_window(self, streams: list[Stream]) -> HostCopy:
        """Queue one window of up to ``steps_per_sync`` audio frames per stream."""
        inputs = AudioStepInputs.from_steps(
            [s.schedule.next_step() for s in streams], [s.plan.request.seed or 0 for s in streams],
            [s.tts_steps for s in streams], self.options.tts_sampling == "greedy",
            self.model.config.tts.num_vq)
        return self.runner.launch_audio_window([s.slot for s in streams], inputs)

    def _take_frames(self, streams: list[Stream], launched: HostCopy) -> tuple[list, list]:
        """The window's frames (waits for them); each schedule replays its stream's frames in
        order (its call ends exactly where the device stopped). Returns the decode jobs and the
        follow-up work (prefills of carried segments)."""
        window = launched.wait()
        made = window[:, :, -1].sum(dim=0).tolist()
        codes = window[:, :, :-1].permute(1, 0, 2).tolist()  # [B][steps][vq]
        decode_jobs: list[tuple[Stream, DecodeJob]] = []
        follow_up: list[tuple[Stream, object]] = []
        for stream, count, frames in zip(streams, made, codes):
            for frame in frames[:count]:
                stream.tts_steps += 1
                for item in stream.schedule.on_frame(frame):
                    (decode_jobs if isinstance(item, DecodeJob) else follow_up).append((stream, item))
        return decode_jobs, follow_up

    # ---- emit and release ----------------------------------------------------------------

    def _launch_decode(self, jobs: list[tuple[Stream, DecodeJob]]) -> None:
        """Queue the decode of this step's jobs; the next step emits their audio
        (:meth:`_emit_decoded`), and completes the streams they finished."""
        decoded = [(s, j) for s, j in jobs if j.frames and not s.done]
        audio = self.runner.launch_decode([j.frames for _, j in decoded]) if decoded else None
        self._pending_decode = PendingDecode(jobs, decoded, audio)

    def _emit_decoded(self) -> None:
        """Join the last step's decoded audio into its streams and send what is final; complete
        the streams it finished; deliver it all now. A stream that ended since (aborted, failed)
        gets nothing."""
        pending, self._pending_decode = self._pending_decode, None
        if pending is None:
            return
        audio = pending.audio.wait() if pending.audio is not None else []
        join_decoded(self._outbox, [(s, j, a) for (s, j), a in zip(pending.decoded, audio)
                                    if not s.done], pending.jobs)
        for stream, _ in pending.jobs:
            if not stream.done and stream.schedule.phase is Phase.DONE:
                self._complete(stream)
        self._outbox.deliver()

    def _release_voice(self, stream: Stream) -> None:
        """The stream no longer holds its voice (the table may drop it again)."""
        self.voices.release([stream.voice])
        stream.voice = None

    def _complete(self, stream: Stream) -> None:
        if self.options.keep_traces and stream.schedule is not None:
            self._traces[stream.request_id] = stream.schedule
        tail = stream.joiner.finish() if stream.joiner is not None else np.zeros(0, np.float32)
        self.scheduler.release(stream)
        self._release_voice(stream)
        emit(self._outbox, stream, tail, final=True)
        stream.done = True
        self.scheduler.count(completed=1)

    def _fail(self, stream: Stream, error: BaseException) -> None:
        if stream.done:
            return
        self.scheduler.release(stream)
        self._release_voice(stream)
        stream.done = True
        self.scheduler.count(failed=1)
        send(self._outbox, stream, error)

    def _end_aborted(self) -> None:
        for stream in self.scheduler.take_aborted():
            self._release_voice(stream)
            stream.done = True
            send(self._outbox, stream, RequestAbortedError("aborted"))

    def _inject_faults(self) -> None:
        """Fault injection (tests only): fail or crash streams whose text holds a marker."""
        for stream in self.scheduler.running():
            action = self._faults.action(stream.plan.request.text, stream.chunks_sent)
            if action == "crash":
                crash_process(stream.request_id)
            elif action == "fail":
                logger.error("request %s failed: injected fault", stream.request_id)
                self._fail(stream, EngineError("speech synthesis failed (injected fault)"))
