"""Where a new stream's first audio is cut (``first_chunk_frames``): the first chunk, and the
extra cuts after it that keep the listener fed until whole calls can.

Upstream decodes audio once per generate call of C = ``chunk_frames`` (25) code frames. Cutting
a call's audio early (the codes are unchanged, only where the decoder cuts) sends the first
audio after F frames instead of C. But the listener starts playing then, from a thin buffer:
each later chunk must arrive before the audio already received has played out. The engine makes
w = ``steps_per_sync`` (5) frames a step for every stream, so the piece that ends at frame g
arrives ``(g - F) / w`` steps after the first chunk; by then the listener holds the audio of the
frames up to the previous cut, less the ``CONTEXT_FRAMES`` (4) every piece holds back for the
crossfade. A frame is 21.3 ms of audio, and a step at load takes 40-70 ms on an H100.

:func:`piece_cuts` plans the cuts from F on: where the rest of a call would come too late, it
cuts the call's audio at the next step's end too, so the buffer grows by a step's audio less a
step's time (5 x 21.3 ms - s) each step; once the listener holds enough for a whole call's
steps it leaves the calls whole (upstream's pieces), for the rest of the stream. Steps are
planned :data:`STEP_TIME_MARGIN` slower than the recent ones, and every arrival is allowed to be
:data:`SLACK_STEPS` steps later still (a step with admission prefills or a garbage collection
takes up to twice the mean). :class:`FirstChunkPlanner` follows the engine's step time (up at
once, down slowly) and gives each new stream the plan with the shortest first chunk that has
one.

Measured on an H100 (docs/benchmarks/history/engine-h100-3803f57-first15.json): a fixed first
chunk of 15 frames and whole calls after it, at 640 read streams (56 ms steps), cut TTFB p50 from
407 to 261 ms but left 69 % of the streams running dry before the second call's audio; planned
cuts with two steps of slack alone (2704484) held 640 (TTFB p99 337 ms) but left 12 % dry at 704.
"""

from __future__ import annotations

from ..model.codec import CONTEXT_FRAMES, SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from ..options import EngineOptions

FRAME_S = SAMPLES_PER_CODE_FRAME / SAMPLE_RATE_HZ  # audio of one code frame: 21.3 ms
# How many steps late any chunk may arrive without the listener running dry: a step with
# admission prefills or a collection takes up to about twice the mean (step_ms p99 / p50 on an
# H100 at 512-704 read streams: 1.6-2.1).
SLACK_STEPS = 2.0
# ... and a run of steps is planned this much slower than the recent mean step (the lateness of
# several slow steps adds up)
STEP_TIME_MARGIN = 1.25
# Extra cuts only within a stream's first calls: a stream that would need more is on an engine
# too close to real time for a short first chunk (it gets upstream's pieces).
MAX_CUT_FRAMES = 100
# How fast the recent step time follows new steps: an exponential average that follows a
# slower step at once (~3 steps) and a faster one over ~10 steps.
STEP_TIME_WEIGHT_UP = 0.3
STEP_TIME_WEIGHT_DOWN = 0.1


def audio_sent_s(frame: int) -> float:
    """The audio a listener holds once the piece ending at ``frame`` of a call has come: every
    piece holds back CONTEXT_FRAMES for the crossfade with the next."""
    return (frame - CONTEXT_FRAMES) * FRAME_S


def piece_cuts(first: int, step_s: float, chunk_frames: int, window: int,
               slack_steps: float = SLACK_STEPS) -> tuple[int, ...] | None:
    """The frames (counted from the stream's start) at which its audio is cut inside a generate
    call, the first chunk's end ``first`` included, so that a listener who starts at the first
    chunk never runs dry while steps take ``step_s``; None if no such cuts exist."""
    if step_s * STEP_TIME_MARGIN >= window * FRAME_S:
        return None  # (nearly) slower than real time: no buffer ever grows

    def arrives(frame: int) -> float:  # the piece ending at ``frame``, after the first chunk
        return ((frame - first) / window * STEP_TIME_MARGIN + slack_steps) * step_s

    cuts, last = [first], first
    while last <= MAX_CUT_FRAMES:
        if last % chunk_frames == 0 and arrives(last + chunk_frames) <= audio_sent_s(last):
            return tuple(cut for cut in cuts if cut % chunk_frames)  # whole calls from here
        call_end = (last // chunk_frames + 1) * chunk_frames
        if arrives(call_end) <= audio_sent_s(last):
            last = call_end  # the rest of this call in one piece
            continue
        step_end = min((last // window + 1) * window, call_end)
        if arrives(step_end) > audio_sent_s(last):
            return None
        cuts.append(step_end)
        last = step_end
    return None


class FirstChunkPlanner:
    """Follows the engine's step time and plans each new stream's cuts (:func:`piece_cuts`)."""

    on_demand = False  # no cuts besides the plan (see :mod:`.audio_cuts`)
    uncut_thin = 0  # thin listeners left uncut: none counted (admission by work reads it)

    def __init__(self, options: EngineOptions) -> None:
        self.chunk_frames = options.chunk_frames
        self.window = options.steps_per_sync
        self.lengths = options.first_chunk_lengths
        self.follows_load = options.first_chunk_follows_load
        self.step_s: float | None = None  # recent step time (None before the first step)

    def observe(self, step_s: float) -> None:
        """A step took ``step_s`` seconds."""
        previous = self.step_s
        if previous is None:
            self.step_s = step_s
            return
        weight = STEP_TIME_WEIGHT_UP if step_s > previous else STEP_TIME_WEIGHT_DOWN
        self.step_s = previous + weight * (step_s - previous)

    def cuts_at_admission(self) -> tuple[int, ...]:
        """Where a stream admitted now has its audio cut inside its generate calls (empty:
        upstream's pieces, one per call)."""
        if not self.lengths:
            return ()
        if not self.follows_load:
            return (self.lengths[0],)
        for first in self.lengths:
            cuts = piece_cuts(first, self.step_s or 0.0, self.chunk_frames, self.window)
            if cuts is not None:
                return cuts
        return ()
