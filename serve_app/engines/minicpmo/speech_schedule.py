"""Per-stream state machine of the TTS stage, one request at a time (docs/minicpmo.md,
"The streaming schedule").

A :class:`SpeechSchedule` holds no tensors. It consumes text pieces and generated frames and
tells the engine what work the stream needs next (a text prefill, a carried-audio prefill, audio
steps, a decode); the engine batches that work across all streams. Keeping the schedule pure
is what makes a stream behave identically alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from .model.codec import CONTEXT_FRAMES
from .model.modeling import TTSConfig
from .text import (
    TTS_EOS_MARK,
    cut_pieces,
    detect_language,
    has_speakable_text,
    sentence_end,
    spoken_form,
)

SEGMENT_TEXT_LIMIT_MARGIN = 180  # a new segment may start once L >= reserved - 180 (= 120)
CARRY_TEXT_TOKENS = 5
CARRY_FRAMES = 50
MIN_FRAMES_PER_CALL = 10  # end-of-audio is forbidden for the first 10 frames of every call


class Phase(Enum):
    WAITING_TEXT = "waiting_text"  # needs the next piece (or the end of the text)
    GENERATING = "generating"      # inside a generate call: needs audio steps
    DONE = "done"


@dataclass
class TextPrefill:
    """Write text embeddings for positions ``start .. start+len(token_ids)-1`` (causal)."""

    token_ids: list[int]
    start: int
    with_speaker: bool


@dataclass
class CarryPrefill:
    """Write ``[Ptts]`` and the carried frames (all but the last) at positions 302.. in one pass."""

    frames: list[list[int]]


@dataclass
class DecodeJob:
    """Decode these frames (with context) into one audio piece; ``new_segment`` resets the join."""

    frames: list[list[int]]
    segment_start: bool
    last_of_segment: bool


NEVER = 1 << 30  # ``eos_after`` of a stream whose length is fixed: end-of-audio never allowed


@dataclass
class AudioStep:
    """Inputs of the stream's next audio step, and how many more steps its call may take
    (``steps_left``: the engine may chain that many on the device without asking again)."""

    position: int
    bos: bool
    frame: list[int] | None
    text_len: int
    call_frames: int
    eos_after: int
    steps_left: int
    apply_warpers: bool


def text_prefill(config: TTSConfig, stts_id: int, text_ids: list[int], begin: int,
                 end: int) -> list[object]:
    """The prefill of positions ``begin .. end-1`` of the text layout ``[Stts] [spk_emb]
    t_1..t_L [Etts]`` (positions 0..L+2; no [Etts] when L is full), or none when empty."""
    if end <= begin:
        return []
    layout = [stts_id, config.spk_emb_token_id] + text_ids
    if len(text_ids) < config.streaming_text_reserved_len:
        layout.append(config.text_eos_token_id)
    return [TextPrefill(layout[begin:end], begin, with_speaker=begin == 0)]


def chunk_prefill_range(config: TTSConfig, chunk_index: int) -> tuple[int, int]:
    """The layout positions a text prefill writes once chunk ``chunk_index`` of the streamed
    text is complete (the first also writes ``[Stts] [spk_emb]``)."""
    chunk = config.streaming_text_chunk_size
    if chunk_index == 0:
        return 0, chunk + config.text_start
    begin = chunk_index * chunk + config.text_start
    return begin, min((chunk_index + 1) * chunk + config.text_start, config.condition_length - 1)


def tail_prefill_range(config: TTSConfig, chunk_index: int, text_len: int) -> tuple[int, int]:
    """The layout positions the text prefill of the tail writes: what ``chunk_index`` complete
    chunks did not, up to ``[Etts]`` after ``text_len`` text tokens."""
    c = config
    begin = 0 if chunk_index == 0 else chunk_index * c.streaming_text_chunk_size + c.text_start
    return begin, min(text_len + c.text_start + 1, c.condition_length - 1)


def carried_segment_work(config: TTSConfig, stts_id: int, carried_text: list[int],
                         carried_frames: list[tuple[int, ...]]) -> list[object]:
    """A carried segment's first work: reset the stream's cache, prefill ``[Stts] [spk_emb]``
    and the carried text, then ``[Ptts]`` and the carried frames."""
    work: list[object] = ["reset_cache"]
    work += [TextPrefill([stts_id, config.spk_emb_token_id] + list(carried_text), 0, True)]
    if carried_frames:
        work.append(CarryPrefill(carried_frames))
    return work


@dataclass
class SpeechSchedule:
    config: TTSConfig
    tokenize: Callable[[str], list[int]]
    decode_tokens: Callable[[Sequence[int]], str]
    chunk_frames: int = 25
    # frames (counted from the stream's start) at which a generate call's audio is also
    # decoded and sent, besides each call's end (step/first_chunk.py): the first chunk's end,
    # then each cut made while the listener ran thin (:meth:`cut_now`). Empty: upstream's pieces
    # exactly. The codes never change, only where the decoder cuts the audio
    extra_cuts: set[int] = field(default_factory=set)
    max_segment_frames: int = 2048
    max_positions: int = 4096
    ignore_eos: bool = False
    total_frame_limit: int | None = None
    stts_id: int = 0

    phase: Phase = Phase.WAITING_TEXT
    gen_text: str = ""
    gen_text_raw: str = ""
    language: str | None = None
    piece_in_segment: int = 0
    first_piece_seen: bool = False
    carried_segment: bool = False
    chunk_index: int = 0
    text_ids: list[int] = field(default_factory=list)
    segment_frames: list[tuple[int, ...]] = field(default_factory=list)
    cache_len: int = 0
    call_frames: int = 0
    decoded_upto: int = 0
    in_tail: bool = False
    pending_new_segment: bool = False
    text_left: str = ""
    stopped: bool = False
    frames_total: int = 0
    segment_started_fresh: bool = True
    text_since_emit: str = ""
    # this segment's pieces as received and as added to ``gen_text`` (for :meth:`cut_at_break`)
    piece_log: list[tuple[str, str]] = field(default_factory=list)
    carry_chars: int = 0  # leading characters of ``gen_text`` carried from the last segment
    cut_at_a_break: bool = False  # this segment ends at a break of streamed text
    after_break: bool = False  # this segment follows such a cut
    left_to_speak: bool = False  # ... and that cut left text before any new piece
    # trace of what was generated: per segment its frames, per call the segment length after it
    call_lengths: list[int] = field(default_factory=list)
    finished_segments: list[list[list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache_len = self.config.audio_bos_position

    # ---- text side -------------------------------------------------------------------------

    @property
    def text_len(self) -> int:
        return len(self.text_ids)

    def _retokenize(self) -> None:
        ids = self.tokenize(self.gen_text)
        self.text_ids = ids[: self.config.streaming_text_reserved_len]

    def accept_piece(self, piece: str) -> list[object]:
        """Consume one text piece; returns work to run (prefill + start of a call) or []."""
        assert self.phase is Phase.WAITING_TEXT
        piece = piece.split(TTS_EOS_MARK)[0]
        self.text_since_emit += piece
        if not self.first_piece_seen and not self.carried_segment:
            self.first_piece_seen = True
            self.gen_text += piece
            self.gen_text_raw += piece
            self.piece_log.append((piece, piece))
            self._retokenize()
            return []
        self.piece_in_segment += 1
        self.gen_text_raw += piece
        if (self.piece_in_segment == 1 and piece == "" and self.carried_segment
                and not self.after_break):
            self._finish()
            return []
        if self.piece_in_segment <= 2:
            self.language = detect_language(self.gen_text_raw)
        added = spoken_form(piece, self.language)
        self.gen_text += added
        self.piece_log.append((piece, added))
        self._retokenize()
        c = self.config
        if self.text_len >= c.streaming_text_reserved_len - SEGMENT_TEXT_LIMIT_MARGIN:
            mark = sentence_end(piece)
            if mark:
                cut = self.gen_text.rfind(mark)
                self.text_left = self.gen_text[cut + 1:]
                self.gen_text = self.gen_text[: cut + 1]
                self._retokenize()
                self.pending_new_segment = True
                return self._start_tail()
        if self.text_len >= (self.chunk_index + 1) * c.streaming_text_chunk_size:
            work = self._prefill(*chunk_prefill_range(c, self.chunk_index))
            self.chunk_index += 1
            self._start_call()
            return work
        return []

    def end_of_text(self) -> list[object]:
        """The text source is exhausted: prefill what is left and generate to the end."""
        assert self.phase is Phase.WAITING_TEXT
        if self.carried_segment and self.piece_in_segment == 0 and not self.left_to_speak:
            self._finish()  # upstream: a carried segment that gets no new text ends the stream
            return []
        if self.carried_segment and self.piece_in_segment == 0:
            self._retokenize()  # the text a cut at a break left (only the carried ids so far)
        return self._start_tail()

    def cut_at_break(self, piece: str, after: str) -> list[object] | None:
        """Streamed text stopped coming (``TextFeed.break_point``): add ``piece``, cut this
        segment's text before the last ``after`` characters of its pieces and speak it to its end
        now; the rest starts the next segment, as after a long text's cut. Returns the work, or
        None (nothing changed) when there is nothing new to speak, ``after`` is not where this
        segment's pieces end, or the cut would change text already prefilled."""
        assert self.phase is Phase.WAITING_TEXT
        cut = cut_pieces(self.piece_log, self.gen_text, self.gen_text_raw, after, self.language)
        if cut is None:
            return None
        gen_text, raw, left = cut
        fresh = not self.first_piece_seen and not self.carried_segment
        language = self.language
        if piece and not fresh and self.piece_in_segment < 2:
            language = detect_language(raw + piece)
        gen_text += piece if fresh else spoken_form(piece, language)
        if not has_speakable_text(gen_text[self.carry_chars:]):
            return None
        ids = self.tokenize(gen_text)[: self.config.streaming_text_reserved_len]
        prefilled = self.chunk_index * self.config.streaming_text_chunk_size
        if len(ids) < prefilled or ids[:prefilled] != self.text_ids[:prefilled]:
            return None
        if piece and not fresh:
            self.piece_in_segment += 1
        self.language = language
        self.text_since_emit += piece
        self.first_piece_seen = True
        self.gen_text, self.gen_text_raw, self.text_ids = gen_text, raw + piece, ids
        self.text_left = left
        self.cut_at_a_break = True
        self.pending_new_segment = True
        return self._start_tail()

    def _prefill(self, begin: int, end: int) -> list[object]:
        return text_prefill(self.config, self.stts_id, self.text_ids, begin, end)

    def _start_tail(self) -> list[object]:
        self.in_tail = True
        work = self._prefill(*tail_prefill_range(self.config, self.chunk_index, self.text_len))
        self._start_call()
        return work

    def _start_call(self) -> None:
        self.phase = Phase.GENERATING
        self.call_frames = 0

    # ---- audio side ------------------------------------------------------------------------

    def next_step(self) -> AudioStep:
        bos = self.cache_len == self.config.audio_bos_position
        steps_left = min(self.chunk_frames - self.call_frames, self.position_capacity_left())
        if self.total_frame_limit is not None:
            steps_left = min(steps_left, self.total_frame_limit - self.frames_total)
        return AudioStep(position=self.cache_len, bos=bos,
                         frame=None if bos else self.segment_frames[-1],
                         text_len=self.text_len, call_frames=self.call_frames,
                         eos_after=NEVER if self.ignore_eos else MIN_FRAMES_PER_CALL,
                         steps_left=max(steps_left, 1), apply_warpers=not bos)

    def position_capacity_left(self) -> int:
        return self.max_positions - 1 - self.cache_len

    def on_frame(self, codes: list[int]) -> list[object]:
        """Record the frame sampled by an audio step; returns decode jobs and follow-up work."""
        self.cache_len += 1
        self.call_frames += 1
        finished = (not self.ignore_eos) and self.config.eos_code in codes
        if not finished:
            # a tuple: once the collector has seen it, it stops tracking it (ints only), so a
            # full collection does not walk every frame of every running stream (65 ms once
            # at 384 streams on an H100 with lists)
            self.segment_frames.append(tuple(codes))
            self.frames_total += 1
        limit_hit = self.total_frame_limit is not None and self.frames_total >= self.total_frame_limit
        out_of_room = self.position_capacity_left() <= 0
        call_over = finished or limit_hit or out_of_room or self.call_frames >= self.chunk_frames
        if not call_over:
            if self.frames_total in self.extra_cuts and not self.carried_segment:
                return self._piece_job(last=False)
            return []
        self.call_lengths.append(len(self.segment_frames))
        jobs = self._piece_job(last=finished or limit_hit or out_of_room)
        if finished or limit_hit:
            if not self.in_tail or limit_hit:
                self.stopped = limit_hit
                return jobs + self._end_segment(allow_next=not limit_hit and self.in_tail)
            return jobs + self._end_segment(allow_next=True)
        if out_of_room or (self.in_tail and len(self.segment_frames) > self.max_segment_frames):
            self.stopped = True
            return jobs + self._end_segment(allow_next=False)
        if self.in_tail:
            self._start_call()
            return jobs
        self.phase = Phase.WAITING_TEXT
        return jobs

    def on_frames(self, frames: list[list[int]]) -> list[object]:
        """:meth:`on_frame` for a window's frames, in order. The device ends a call only at its
        last frame (the call's length, the limits, end-of-audio), so the frames before it are
        recorded at once where no cut falls among them (a step's host time, at 1024 streams)."""
        early, start = frames[:-1], self.frames_total
        if not early or (not self.carried_segment and any(
                start + n in self.extra_cuts for n in range(1, len(early) + 1))) or (
                not self.ignore_eos and any(self.config.eos_code in c for c in early)):
            return [job for codes in frames for job in self.on_frame(codes)]
        self.cache_len += len(early)
        self.call_frames += len(early)
        self.frames_total += len(early)
        self.segment_frames.extend(map(tuple, early))
        return self.on_frame(frames[-1])

    def cut_now(self) -> list[object]:
        """The call's audio so far as a piece, now (its listener runs thin); none in a carried
        segment, or with no new frame."""
        if (self.phase is not Phase.GENERATING or self.carried_segment
                or len(self.segment_frames) <= self.decoded_upto):
            return []
        self.extra_cuts.add(self.frames_total)
        return self._piece_job(last=False)

    def _piece_job(self, last: bool) -> list[object]:
        """Decode the segment's frames since the last piece, with up to CONTEXT_FRAMES before
        them as context."""
        start = max(self.decoded_upto - CONTEXT_FRAMES, 0)
        frames = self.segment_frames[start:]
        segment_start = self.segment_started_fresh
        self.segment_started_fresh = False
        self.decoded_upto = len(self.segment_frames)
        return [DecodeJob(frames, segment_start, last)]

    def _end_segment(self, allow_next: bool) -> list[object]:
        """The segment's audio is complete: start a carried segment or finish the stream."""
        self.finished_segments.append(self.segment_frames)
        if not (allow_next and self.pending_new_segment and not self.stopped):
            self._finish()
            return []
        return start_carried_segment(self)

    def _finish(self) -> None:
        self.phase = Phase.DONE


def start_carried_segment(schedule: SpeechSchedule) -> list[object]:
    """A long text's next segment: it starts from the last segment's closing text tokens and
    frames (upstream's carry), with the text left over; returns its first work."""
    c = schedule.config
    carried_text = schedule.text_ids[-CARRY_TEXT_TOKENS:]
    carried_frames = schedule.segment_frames[-CARRY_FRAMES:]
    text = schedule.decode_tokens(carried_text)
    schedule.after_break, schedule.cut_at_a_break = schedule.cut_at_a_break, False
    schedule.left_to_speak = schedule.after_break and has_speakable_text(schedule.text_left)
    schedule.carry_chars = len(text)
    schedule.piece_log = []
    schedule.gen_text = schedule.gen_text_raw = text + schedule.text_left
    schedule.text_left, schedule.text_ids = "", list(carried_text)
    schedule.pending_new_segment = schedule.in_tail = False
    schedule.carried_segment, schedule.piece_in_segment = True, 0
    schedule.chunk_index = len(carried_text) // c.streaming_text_chunk_size
    schedule.segment_frames = [tuple(f) for f in carried_frames]
    schedule.finished_segments[-1] = list(schedule.finished_segments[-1])
    schedule.decoded_upto = len(schedule.segment_frames)
    schedule.segment_started_fresh = True
    schedule.cache_len = c.audio_bos_position + len(carried_frames)
    schedule.phase = Phase.WAITING_TEXT
    return carried_segment_work(c, schedule.stts_id, carried_text, carried_frames)

