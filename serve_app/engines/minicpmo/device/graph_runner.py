"""The model runner on a GPU: :class:`GraphModelRunner` replays the steps of
:class:`~.runner.ModelRunner` as CUDA graphs captured when the engine starts, on CUDA streams
that let the audio window run first and the LLM's work beside it; :func:`create_runner` picks
it or the eager runner."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.codec import CONTEXT_FRAMES
from ..model.layers import SlotKVCache
from ..model.loader import LoadedModel
from ..options import EngineOptions, clones_voices
from ..voices import VoicePrefix, prefix_length
from .audio_step import AudioStepGraphs, AudioStepInputs
from .decode_graphs import DecodedAudio, MultiLengthDecodeGraphs
from .graphs import FirstInLine, separate_capture_stream
from .llm_step import LLMPrefillGraphs, LLMStepGraphs, LLMStepInputs, sample_next_token
from .packed_prefill import PackedPrefillGraphs, PackedPrompts
from .runner import ModelRunner
from .sampling import CANDIDATE_TOP_K
from .transfer import HostCopy
from .tts_prefill import LONG_PREFILL_TOKENS, PREFILL_TOKENS, TextPrefillGraphs

logger = logging.getLogger(__name__)

# Voice-turn lengths the admission prefill graphs are captured for (a 30 s clip's turn is about
# 825 tokens); a longer prefix runs eagerly.
VOICE_PREFIX_BUCKETS = (0, 256, 1024)
# Streams one text prefill graph replay takes (bounded by the slots): at 384 read streams about
# 80 streams a step start a piece, and each replay of 64 rows cost 1-2.5 ms on an H100
TEXT_PREFILL_ROWS = 256
LONG_TEXT_PREFILL_ROWS = 16  # and for long text (few streams a step have any)


class GraphModelRunner(ModelRunner):
    """The same steps replayed as CUDA graphs (captured at start, per batch bucket); a prefill
    batch too large for its graphs and decode lengths without one run eagerly."""

    def __init__(self, model: LoadedModel, options: EngineOptions, penalty_width: int) -> None:
        super().__init__(model, options, penalty_width)
        self._llm_stream: torch.cuda.Stream | None = None  # for llm_launch, made on first use
        self._prefill_stream: torch.cuda.Stream | None = None  # prefill_stream_of_its_own
        self._speech = FirstInLine(self.device)  # the audio window and the decode
        self._window_queued: torch.cuda.Event | None = None  # see launch_audio_window
        self._side_done: torch.cuda.Event | None = None  # see _on_side_stream
        # the window's rows are the generating streams where attention finds each row's slot
        # itself (visible_ranges), not every slot below the highest (audio_window_rows)
        gathered = (options.audio_window_rows == "generating"
                    and options.one_query_attention == "visible_ranges")
        self.audio_graphs = AudioStepGraphs(model.tts, self.tts_cache, self.device, self.window,
                                            whole_span_only=self.reads_only_visible,
                                            gathered=gathered)
        self.text_prefill_graphs = {
            PREFILL_TOKENS: TextPrefillGraphs(model.tts, self.tts_cache, self.device,
                                              max_rows=TEXT_PREFILL_ROWS),
            LONG_PREFILL_TOKENS: TextPrefillGraphs(model.tts, self.tts_cache, self.device,
                                                   max_rows=LONG_TEXT_PREFILL_ROWS,
                                                   width=LONG_PREFILL_TOKENS)}
        # the same for the LLM step's rows: the chat streams that take a token (llm_step_rows)
        self.llm_graphs = LLMStepGraphs(model.llm, self.llm_cache, penalty_width, self.device,
                                        whole_span_only=self.llm_attention == "visible_ranges",
                                        gathered=(options.llm_step_rows == "streams"
                                                  and self.llm_attention == "visible_ranges"))
        self.llm_prefill_graphs = LLMPrefillGraphs(
            model.llm, model.config.llm, self.device, self.dtype, max_batch=options.prefill_prompts,
            prefix_lengths=VOICE_PREFIX_BUCKETS if clones_voices(model, options) else (0,))
        # With prefill_beside_window the admission prefill replays on the LLM step's stream:
        # both are captured on one stream of their own (graphs.py: separate_capture_stream)
        self.prefill_beside_window = options.prefill_beside_window
        # (prefill_stream_of_its_own: on a stream of its own, beside the LLM steps too, so its
        # graphs get a capture stream of their own as well)
        self._own_prefill_stream = options.prefill_stream_of_its_own
        llm_capture = separate_capture_stream()
        prefill_capture = (separate_capture_stream(llm_capture) if self._own_prefill_stream
                           else llm_capture)
        self.packed_graphs = (PackedPrefillGraphs(model.llm, model.config.llm, self.device,
                                                  self.dtype) if self.packed_prefill else None)
        # the admission prefill's graphs (padded and packed): beside the window, or in line
        admission_capture = prefill_capture if self.prefill_beside_window else None
        self.audio_graphs.capture_all()
        self.llm_prefill_graphs.capture_all(admission_capture)
        if self.packed_graphs is not None:
            self.packed_graphs.capture_all(admission_capture)
        for graphs in self.text_prefill_graphs.values():
            graphs.capture_all()
        self.llm_graphs.capture_all(llm_capture)
        longest_piece = options.chunk_frames + CONTEXT_FRAMES
        common = {options.chunk_frames, longest_piece}
        if options.first_chunk_lengths:  # cut calls: first chunks, pieces ending at steps' ends
            for first in options.first_chunk_lengths:
                common |= {first, options.chunk_frames - first + CONTEXT_FRAMES}
            common |= set(range(options.steps_per_sync + CONTEXT_FRAMES, longest_piece,
                                options.steps_per_sync))
        decode_graphs = MultiLengthDecodeGraphs(
            model.decoder, sorted(common), longest_piece,
            min(options.max_slots, 64))
        try:
            decode_graphs.capture_all()
            self.decoder = decode_graphs
        except RuntimeError:
            logger.exception("decode could not be captured as a CUDA graph; decoding eagerly")

    def llm_prefill(self, ids: torch.Tensor, valid: torch.Tensor,
                    voices: Sequence[VoicePrefix | None]) -> tuple[torch.Tensor, SlotKVCache]:
        graphs = self.llm_prefill_graphs
        if not graphs.fits(*ids.shape, max(prefix_length(v) for v in voices)):
            self.work.update(llm_prefill_eager=1)
            return super().llm_prefill(ids, valid, voices)
        return graphs.run(ids, valid, voices), graphs.cache

    def llm_packed(self, packed: PackedPrompts) -> tuple[torch.Tensor, SlotKVCache]:
        graphs = self.packed_graphs
        if graphs is None or not graphs.fits(len(packed.ids)):
            self.work.update(llm_prefill_eager=1)
            return super().llm_packed(packed)
        return graphs.run(packed), graphs.cache

    def launch_decode(self, frames: Sequence[list[list[int]]]) -> DecodedAudio:
        if isinstance(self.decoder, MultiLengthDecodeGraphs):  # pieces of other lengths: eager
            eager = sum(not self.decoder.captured(len(f)) for f in frames)
            if eager:
                self.work.update(decode_eager_pieces=eager)
        with self._speech.queue():
            return super().launch_decode(frames)

    def llm_step(self, slots: list[int], inputs: LLMStepInputs) -> list[int]:
        shape = self.llm_graphs.shape(slots, inputs)
        self._count_llm_step(*shape, inputs)
        return self.llm_graphs.run(slots, inputs, shape).tolist()

    def llm_launch(self, slots: list[int], inputs: LLMStepInputs,
                   beside_window: bool = False) -> object:
        """The LLM step's graph on a CUDA stream of its own: the audio window queued after it
        on the current stream (or, ``beside_window``, queued last, before it) runs beside it."""
        shape = self.llm_graphs.shape(slots, inputs)
        self._count_llm_step(*shape, inputs)
        self.work.update(llm_launches=1)
        after = self._window_queued if beside_window else None
        return self.llm_graphs.launch(slots, inputs, self._side_stream(), shape, after)

    def llm_collect(self, launched: object) -> list[int]:
        return self.llm_graphs.collect(launched).tolist()  # type: ignore[arg-type]

    def _side_stream(self) -> torch.cuda.Stream:
        if self._llm_stream is None:
            self._llm_stream = torch.cuda.Stream(self.device)
        return self._llm_stream

    def _admission_side_stream(self) -> torch.cuda.Stream:
        """The LLM step's stream, or with ``prefill_stream_of_its_own`` one of the prefill's."""
        if not self._own_prefill_stream:
            return self._side_stream()
        if self._prefill_stream is None:
            self._prefill_stream = torch.cuda.Stream(self.device)
        return self._prefill_stream

    def admission_stream(self, beside_window: bool) -> contextlib.AbstractContextManager:
        """With ``prefill_beside_window``, the admission's prefill on the LLM step's stream
        (after its step, whose graphs share its capture stream): beside the audio window when
        ``beside_window`` (after the work queued before the window), else after the current
        stream's work; the current stream waits for it after the block."""
        if not self.prefill_beside_window:
            return contextlib.nullcontext()
        return self._on_side_stream(self._window_queued if beside_window else None)

    @contextlib.contextmanager
    def _on_side_stream(self, after: torch.cuda.Event | None):
        """The block's work on the side stream. Beside the window (``after``), the current
        stream waits for it only at the next step's start (:meth:`join_side_stream`): this
        step's decode does not, and what reads its results (the new streams' text prefills,
        their LLM steps) comes in later steps. Otherwise it waits at once: the same step's text
        prefills read the speaker embeddings it writes."""
        stream = self._admission_side_stream()
        current = torch.cuda.current_stream(self.device)
        if after is None:
            stream.wait_stream(current)
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield
        if after is None:
            current.wait_stream(stream)
        else:
            self._side_done = torch.cuda.Event()
            self._side_done.record(stream)

    def join_side_stream(self) -> None:
        if self._side_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._side_done)
            self._side_done = None

    def launch_first_tokens(self, logits: torch.Tensor, inputs: LLMStepInputs) -> object:
        """Sampled on the device without a sync (from candidates when every row's ``top_k``
        allows, llm_step.sample_next_token), the tokens copied to the host as they come."""
        x = self._on_device(inputs)
        path = "candidates" if int(inputs.top_k.max()) <= CANDIDATE_TOP_K else "full"
        return FirstTokens(logits, x, path, HostCopy(sample_next_token(logits, x, path)))

    def collect_first_tokens(self, launched: object) -> list[int]:
        """The tokens (waits for them); a candidates row that could not be exact is sampled
        again over the whole vocabulary, on the stream the logits were made on."""
        first: FirstTokens = launched  # type: ignore[assignment]
        tokens = first.tokens.wait()
        if first.path == "candidates" and not bool((tokens >= 0).all()):
            with torch.cuda.stream(self._admission_side_stream()):
                tokens = sample_next_token(first.logits, first.inputs, "full").cpu()
        return tokens.tolist()

    def _text_prefill_pass(self, slots: list[int], ids: torch.Tensor, positions: torch.Tensor,
                           valid: torch.Tensor, speaker: torch.Tensor, speaker_at: torch.Tensor) -> None:
        self._count_text_prefill(len(slots), valid)
        self.text_prefill_graphs[ids.shape[1]].run(slots, ids, positions, valid, speaker, speaker_at)

    def launch_audio_window(self, slots: list[int], inputs: AudioStepInputs) -> HostCopy:
        shape = self.audio_graphs.shape(slots, inputs)
        self._count_audio_window(*shape, inputs)
        # what an LLM step launched beside this window waits for: the work queued before it
        self._window_queued = torch.cuda.Event()
        self._window_queued.record()
        with self._speech.queue():
            return self.audio_graphs.launch(slots, inputs, shape)


def create_runner(model: LoadedModel, options: EngineOptions, penalty_width: int) -> ModelRunner:
    """CUDA graphs when they are enabled and the model is on a GPU; eager otherwise."""
    on_gpu = next(model.tts.parameters()).device.type == "cuda"
    runner = GraphModelRunner if options.cuda_graphs and on_gpu else ModelRunner
    return runner(model, options, penalty_width)


@dataclass
class FirstTokens:
    """Chat streams' first tokens sampled from their prefill logits, on their way to the host
    (:meth:`GraphModelRunner.launch_first_tokens`)."""

    logits: torch.Tensor
    inputs: LLMStepInputs
    path: str
    tokens: HostCopy
