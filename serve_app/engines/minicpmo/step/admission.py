"""Admission's work: the streams the scheduler admitted (within the step's token budget,
:class:`~..scheduler.PrefillBudget`) get one batched LLM prefill of their prompts, which gives
each its speaker embedding (a chat stream keeps its prompt in an LLM slot and samples a first
token), and their speech schedules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...base import EngineError
from ..device.runner import ModelRunner
from ..joiner import StreamingAudioJoiner
from ..model.codec import SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from ..model.loader import LoadedModel
from ..options import EngineOptions
from ..scheduler import Stream
from ..speech_schedule import SpeechSchedule
from ..text import GrowingTextTokenizer, splits_at_spaces
from ..voices import prefix_length
from .audio_cuts import OnDemandCuts
from .chat_text import ChatTextSteps
from .first_chunk import FirstChunkPlanner

logger = logging.getLogger(__name__)


class Admission:
    """Starts admitted streams: their prefill pass and their speech schedules."""

    def __init__(self, model: LoadedModel, options: EngineOptions, runner: ModelRunner,
                 chat_text: ChatTextSteps, fail: Callable[[Stream, BaseException], None],
                 spk_id: int, gen_prompt_ids: list[int]) -> None:
        self.model = model
        self.options = options
        self.runner = runner
        self.chat_text = chat_text
        self._fail = fail
        self._spk_id = spk_id
        self._gen_prompt_ids = gen_prompt_ids
        self._stts_id = model.tts_tokenizer.convert_tokens_to_ids("[Stts]")
        # the TTS tokenizer's own (Rust) tokenizer, where a schedule's growing text may be
        # encoded from its last word boundary on (text.GrowingTextTokenizer)
        backend = getattr(model.tts_tokenizer, "backend_tokenizer", None)
        self._growing_backend = backend if backend is not None and splits_at_spaces(backend) else None
        # where streams' audio is cut; the step loop tells it each step's time
        self.audio_cuts = (OnDemandCuts(options) if options.audio_cuts == "on_demand"
                           else FirstChunkPlanner(options))

    def prompt_ids(self, stream: Stream) -> list[int]:
        """The LLM prompt a stream prefills (tokenized when it was submitted; a stream in a
        cloned voice only its own turn, after its voice turn's cached keys)."""
        return stream.plan.prompt_ids + self._gen_prompt_ids

    def start(self, admitted: list[Stream], prompts: list[list[int]],
              beside_window: bool = False) -> None:
        """Prefill the admitted streams' ``prompts`` in one pass (``beside_window``: while the
        device runs the step's audio window; the runner says where it runs) and give them their
        schedules; all of them fail if the prefill does."""
        if not admitted:
            return
        now = time.perf_counter()
        for stream in admitted:
            stream.admitted_at = now
        for stream in admitted:
            self.runner.clear_tts_slot(stream.slot)
        try:
            with self.runner.admission_stream(beside_window):
                self._prefill_pass(admitted, prompts, beside_window)
        except Exception as error:
            logger.exception("prefill failed")
            for stream in admitted:
                self._fail(stream, EngineError(f"prefill failed: {type(error).__name__}"))
            return
        for stream in admitted:
            self._init_schedule(stream)

    def _prefill_pass(self, streams: list[Stream], prompts: list[list[int]],
                      beside_window: bool) -> None:
        """One LLM prefill of the admitted streams' prompts. Beside the window with
        ``prefill_beside_window``, the chat streams' first tokens are not waited for here: they
        are taken after the step's LLM step (``first_text_beside_window``) or at the next step's
        start (:meth:`~.chat_text.ChatTextSteps.take_first_tokens`)."""
        chat_rows = [i for i, s in enumerate(streams) if s.plan.is_chat]
        logits = self.runner.prefill_prompts(prompts, [s.voice for s in streams],
                                             [s.slot for s in streams], self._spk_id, chat_rows,
                                             [streams[i].llm_slot for i in chat_rows])
        if logits is None:
            return
        chat_streams = [streams[i] for i in chat_rows]
        for i, stream in zip(chat_rows, chat_streams):
            self.chat_text.chat.start(stream, prefix_length(stream.voice) + len(prompts[i]))
        launched = self.runner.launch_first_tokens(logits, self.chat_text.chat.inputs(chat_streams))
        self.chat_text.hold_first_tokens(chat_streams, launched)
        if not (beside_window and self.options.prefill_beside_window):
            self.chat_text.take_first_tokens()

    def _tokenizer(self) -> Callable[[str], list[int]]:
        """A new stream's TTS text tokenizer: its ids of a text, as the TTS tokenizer's
        ``encode`` (no special tokens) gives them."""
        backend = self._growing_backend
        if backend is not None:
            return GrowingTextTokenizer(
                lambda text: backend.encode(text, add_special_tokens=False).ids)
        tokenizer = self.model.tts_tokenizer
        return lambda text: tokenizer.encode(text, add_special_tokens=False)

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
            tokenize=self._tokenizer(),
            decode_tokens=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
            chunk_frames=self.options.chunk_frames,
            extra_cuts=set(self.audio_cuts.cuts_at_admission()),
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
