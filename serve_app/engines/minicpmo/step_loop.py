"""The engine's step thread: every step plans, launches and collects for all streams together.

1. plan (what runs this step): end aborted streams; an idle engine admits queued streams
   (within the step's token budget, one batched LLM prefill gives each its speaker embedding;
   chat streams keep their prompt in an LLM slot and sample a first token; a busy engine admits
   while the device runs its window, below); chat streams get their text (LLM steps run now,
   unless one is launched beside the audio window, below); each stream's
   :class:`~.speech_schedule.SpeechSchedule` turns its pieces into TTS work;
2. launch (queue device work): batched TTS text prefills, then one batched window of audio
   steps for every generating stream on the device's highest-priority stream, not waited for;
   then the chat streams' LLM step, on a stream of its own beside the window;
3. collect (read results back): while the device runs the window, the last step's decoded
   audio is handed out (what can no longer change goes to its caller at once) and streams it
   finished complete, and queued streams are admitted (their LLM prefill queued behind the
   window, for the next step's plan); then the window's frames, the prefills of carried
   segments, and this step's batched DVAE + Vocos decode queued on the device (the next step's
   collect hands its audio out); last, the tokens of the LLM step launched beside the window.

The device's work is queued, not waited for, wherever the host has other work: the host
prepares step k+1 while the device decodes step k's audio, and joins and sends step k's audio
while the device runs step k+1's window (copies between them never make the host wait:
transfer.py). The host waits only for the tokens and frames it must read to go on. The parts
live in :mod:`.step`: admission, chat text, text intake, stream endings, and the step record,
phase timing, GC clock and fault injection.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..base import EngineError
from ..faults import FaultInjection
from .chat import ChatText
from .device.audio_step import AudioStepInputs
from .device.runner import DecodedAudio, ModelRunner
from .device.transfer import HostCopy
from .model.codec import SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from .model.loader import LoadedModel
from .options import EngineOptions
from .output import join_decoded
from .scheduler import PrefillBudget, Scheduler, Stream
from .speech_schedule import CarryPrefill, DecodeJob, Phase, SpeechSchedule, TextPrefill
from .step.admission import Admission
from .step.chat_text import ChatTextSteps, LaunchedText, waiting_for_text
from .step.endings import StreamEndings
from .step.faults import inject_faults
from .step.phases import PhaseClock
from .step.record import StepRecord, StepRecorder
from .step.text_intake import TextIntake
from .voices import VoiceTable

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepPlan:
    """What runs in a step once its admissions and text are in (the plan phase's result)."""

    prefills: list[tuple[Stream, object]]  # TTS work from the text the schedules read
    generating: list[Stream]  # streams whose next audio window runs this step
    overlapped: bool  # the chat streams' LLM step is launched beside the window (not run here)
    text: LaunchedText | None  # that LLM step, once launched (in the launch phase)
    admitted: bool  # queued streams were admitted in the plan (else: in the collect phase)


@dataclass(slots=True)
class PendingDecode:
    """A step's decode, queued on the device; the next step hands its audio out."""

    jobs: list[tuple[Stream, DecodeJob]]  # every decode job of the step, empty ones included
    decoded: list[tuple[Stream, DecodeJob]]  # the jobs with frames, in ``audio``'s order
    audio: DecodedAudio | None


class StepLoop:
    """Owns the step thread; the only code that touches running streams and the runner."""

    def __init__(self, model: LoadedModel, options: EngineOptions, scheduler: Scheduler,
                 runner: ModelRunner, chat: ChatText, spk_id: int, gen_prompt_ids: list[int],
                 voices: VoiceTable) -> None:
        self.model = model
        self.options = options
        self.scheduler = scheduler
        self.runner = runner
        self.endings = StreamEndings(options, scheduler, voices)
        self.chat_text = ChatTextSteps(options, scheduler, runner, chat)
        self.admission = Admission(model, options, runner, self.chat_text, self.endings.fail,
                                   spk_id, gen_prompt_ids)
        self.text = TextIntake(options, scheduler, self.endings.complete)
        self.phases = PhaseClock(options, runner.device)
        self.record = StepRecorder(runner.work)
        self.step_log: collections.deque[StepRecord] = self.record.log
        self._faults = FaultInjection.from_options(options.fault_injection)
        self._step_counter = itertools.count()
        self._step_index = 0  # this step's number (admission_interval_steps counts them)
        self._window_ran = False  # the last step ran an audio window (admission: _plan)
        self._pending_decode: PendingDecode | None = None
        self.step_budget_s = options.steps_per_sync * SAMPLES_PER_CODE_FRAME / SAMPLE_RATE_HZ
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
        self.record.close()

    def trace(self, request_id: str) -> SpeechSchedule | None:
        return self.endings.traces.get(request_id)

    def phase_seconds(self) -> dict[str, float]:
        """All steps' time by phase (host time, device time too with ``profile_phases``)."""
        return dict(self.phases.totals)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            if self.scheduler.idle():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            started_s = self.record.start()
            cpu_started_s = time.thread_time()
            open_by_kind = self.scheduler.open_by_kind()
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as error:  # one bad step must not kill the loop; fail its streams
                logger.exception("engine step failed")
                self._pending_decode = None
                for stream in self.scheduler.running():
                    self.endings.fail(
                        stream, EngineError(f"engine step failed: {type(error).__name__}"))
            # logged before the step's batched deliveries (the engine process's wire); a per-item
            # sink (this process's event loop) had each item at once, before the step's log
            self.record.finish(self.phases.take_step())
            self.endings.outbox.deliver()
            step_s = time.perf_counter() - started_s
            ran_dry = self.endings.outbox.take_ran_dry()
            self.scheduler.count_step_time(step_s, time.thread_time() - cpu_started_s, ran_dry)
            self.admission.audio_cuts.observe(step_s)
            # the step's load against what ran in it (the streams open when it began)
            self.scheduler.work.observe_step(open_by_kind, step_s / self.step_budget_s, step_s,
                                             ran_dry, self.admission.audio_cuts.uncut_thin)

    def _step(self) -> None:
        """One engine step: plan -> launch -> collect (their device work in this order)."""
        self.phases.start()
        plan = self._plan()
        window = self._launch(plan)
        self._collect(plan, window)
        self.scheduler.count_step(len(plan.generating))
        self.record.generating = len(plan.generating)

    # ---- the three phases ------------------------------------------------------------------

    def _plan(self) -> StepPlan:
        """What runs this step: aborted streams end; an idle engine admits queued streams
        within the step's token budget and prefills them (a busy one in :meth:`_collect`);
        chat streams' LLM steps run now, unless their next one is launched beside the audio
        window (:meth:`_launch`); the schedules read their text into TTS work; the streams
        whose audio is generating run a window."""
        self._step_index = next(self._step_counter)
        # what the last step left beside its window: its admission prefill (the device), the
        # chat streams' first tokens (the host)
        self.runner.join_side_stream()
        self.chat_text.take_first_tokens(counted_as="first_tokens_next_step")
        self.endings.end_aborted()
        self.endings.refuse_late(time.perf_counter())
        if self._faults is not None:
            inject_faults(self._faults, self.scheduler.running(), self.endings.fail)
        # An engine with no running stream, or whose last step ran no audio window, admits
        # here; one that ran a window admits in _collect, while the device runs this step's
        # (or, if this step runs none, here in the next step)
        admit_now = not self._window_ran or not self.scheduler.running()
        if admit_now:
            self._admit()
        self.phases.lap("admit_prefill")
        overlapped = self.chat_text.overlaps()
        if not overlapped:
            self.chat_text.decode()
        self.phases.lap("llm_decode")
        self.text.take_fed_text()
        prefills = self.text.tts_work(self.scheduler.running())
        generating = [s for s in self.scheduler.running()
                      if s.schedule is not None and s.schedule.phase is Phase.GENERATING]
        self.phases.lap("schedule")
        return StepPlan(prefills, generating, overlapped, None, admit_now)

    def _launch(self, plan: StepPlan) -> HostCopy | None:
        """Queue the step's device work: the TTS text prefills, then one window of up to
        ``steps_per_sync`` audio frames per generating stream (its frames are read in
        :meth:`_collect`), then, when the plan overlaps it, the chat streams' LLM step beside
        the window (the host prepares it while the device runs the window)."""
        self._run_tts_prefills(plan.prefills)
        self.phases.lap("tts_prefill")
        window = self._launch_audio_window(plan.generating) if plan.generating else None
        self.phases.lap("tts_step")
        if plan.overlapped:  # its host work while the device runs the window
            plan.text = self.chat_text.launch(beside_window=window is not None)
            self.phases.lap("llm_decode")
        return window

    def _collect(self, plan: StepPlan, window: HostCopy | None) -> None:
        """Read the results back: the last step's decoded audio handed out while the device
        runs the window; the LLM step's tokens, first if a stream's speech waits for text (with
        more LLM steps beside the window), else last; the window's frames, with the work they
        give queued at once: carried segments' prefills and this step's decode (whose audio the
        next step's collect hands out)."""
        self._emit_decoded()
        self.phases.lap("decode_emit")
        self._window_ran = bool(plan.generating)
        if plan.generating and not plan.admitted:
            # Admission while the device runs the window: its LLM prefill is queued behind the
            # window and runs while the host reads the frames (where the device would wait),
            # and the new streams' schedules are ready for the next step's plan, which would
            # have admitted them; their first window is the same step's either way.
            self._admit(beside_window=True)
            self.phases.lap("admit_prefill")
        text = plan.text
        if ((text is not None and waiting_for_text(text.streams))
                or (self.options.first_text_beside_window
                    and self.chat_text.holds_first_tokens())):
            self.chat_text.beside_window(text)
            text = None
            self.phases.lap("llm_decode")
        decode_jobs, follow_up = (self._take_frames(plan.generating, window) if plan.generating
                                  else ([], []))
        self.phases.lap("tts_step")
        self._run_tts_prefills(follow_up)
        self.phases.lap("tts_prefill")
        self._launch_decode(decode_jobs)
        self.phases.lap("decode_emit")
        if text is not None:
            self.chat_text.collect(text)
            self.phases.lap("llm_decode")

    def _admit(self, beside_window: bool = False) -> None:
        """Admit queued streams within the step's token budget and start them (their prefill
        pass and speech schedules; ``beside_window``: while the device runs the window)."""
        budget = PrefillBudget(self.options.prefill_prompts, self.options.prefill_tokens)
        admitted = self.scheduler.admit_within(self._step_index, budget, self.admission.prompt_ids)
        self.endings.refuse_late(time.perf_counter(), next_step=True)  # those it passed over
        self.record.admitted += admitted
        self.admission.start(admitted, budget.prompts, beside_window)

    # ---- TTS work on the device ------------------------------------------------------------

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
        order (its call ends exactly where the device stopped); a stream whose listener runs
        thin has its call's audio so far cut too (step/audio_cuts.py). Returns the decode jobs
        and the follow-up work (prefills of carried segments)."""
        window = launched.wait()
        made = window[:, :, -1].sum(dim=0).tolist()
        # [B][steps][vq]; numpy's tolist of the view: 1.2 ms against torch's 5.4 ms at 700 rows
        # (a 2-core x86 box), on the step's critical path while the device waits
        codes = window[:, :, :-1].permute(1, 0, 2).numpy().tolist()
        decode_jobs: list[tuple[Stream, DecodeJob]] = []
        follow_up: list[tuple[Stream, object]] = []
        for stream, count, frames in zip(streams, made, codes):
            if not count:
                continue
            stream.tts_steps += count
            for item in stream.schedule.on_frames(frames[:count]):
                (decode_jobs if isinstance(item, DecodeJob) else follow_up).append((stream, item))
        cuts = self.admission.audio_cuts
        if cuts.on_demand:  # of the streams without a piece this step, those running thin
            cut = {id(stream) for stream, _ in decode_jobs}
            for stream in cuts.running_thin([s for s in streams if id(s) not in cut],
                                            time.perf_counter()):
                decode_jobs.extend((stream, job) for job in stream.schedule.cut_now())
        return decode_jobs, follow_up

    # ---- decoded audio out -----------------------------------------------------------------

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
        outbox = self.endings.outbox
        silent = [s for s, _ in pending.decoded if s.first_audio_at is None]
        join_decoded(outbox, [(s, j, a) for (s, j), a in zip(pending.decoded, audio)
                              if not s.done], pending.jobs)
        self.endings.time_first_audio(silent)
        for stream, _ in pending.jobs:
            if not stream.done and stream.schedule.phase is Phase.DONE:
                self.endings.complete(stream)
        outbox.deliver()
