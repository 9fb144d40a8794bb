"""How many code frames a new stream's first audio chunk holds (``first_chunk_frames``).

A shorter first chunk reaches the listener sooner, but the listener then plays from a thinner
buffer: every later chunk has to arrive before the audio already received has played out. The
first generate call is cut once, at ``F`` frames; its rest arrives ``ceil((C - F) / w)`` steps
later (C = ``chunk_frames``, w = ``steps_per_sync`` frames a step), the second call's chunk a
whole call of steps after that. Each chunk leaves the last ``CONTEXT_FRAMES`` frames held back
for the crossfade. So, with s the step time and a the audio of one frame (21.3 ms), a first
chunk of F frames keeps the buffer from running dry while

- the first call's rest is in time: ``ceil((C - F) / w) * s <= (F - 4) * a``, and
- the second call's chunk is in time: ``(ceil((C - F) / w) + ceil(C / w)) * s <= (C - 4) * a``

(later calls only gain: a call makes C frames of audio in ``ceil(C / w)`` steps, faster than
real time while ``s < w * a``). The planner checks both against the engine's recent step time
times ``first_chunk_safety`` (steps vary: admission prefills, collections) and picks the
smallest such F from ``first_chunk_frames`` up in steps of w, else a whole call. With the
defaults (C 25, w 5, safety 1.5): 10 frames while steps take <= 28 ms, 15 to 42 ms, 20 to 50 ms,
a whole call above that. On an H100 a step takes 9 ms for one stream and ~56 ms at 640 read
streams; at 640 a fixed 15-frame first chunk left 69 % of the streams running dry.
"""

from __future__ import annotations

import math

from ..model.codec import CONTEXT_FRAMES, SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from ..options import EngineOptions

FRAME_S = SAMPLES_PER_CODE_FRAME / SAMPLE_RATE_HZ  # audio of one code frame: 21.3 ms
# How fast the recent step time follows new steps (an exponential average over ~10 steps).
STEP_TIME_WEIGHT = 0.1


def keeps_buffer(first_frames: int, step_s: float, chunk_frames: int, window: int) -> bool:
    """A first chunk of ``first_frames`` frames keeps the listener's buffer from running dry
    while steps take ``step_s`` (the two conditions in this module's docstring)."""
    if first_frames >= chunk_frames:
        return True
    to_rest = math.ceil((chunk_frames - first_frames) / window)
    to_second_call = to_rest + math.ceil(chunk_frames / window)
    return (to_rest * step_s <= (first_frames - CONTEXT_FRAMES) * FRAME_S
            and to_second_call * step_s <= (chunk_frames - CONTEXT_FRAMES) * FRAME_S)


class FirstChunkPlanner:
    """Follows the engine's step time and gives each new stream its first chunk's length."""

    def __init__(self, options: EngineOptions) -> None:
        self.chunk_frames = options.chunk_frames
        self.window = options.steps_per_sync
        self.shortest = options.first_piece_frames
        self.safety = options.first_chunk_safety
        self.step_s: float | None = None  # recent step time (None before the first step)

    def observe(self, step_s: float) -> None:
        """A step took ``step_s`` seconds."""
        previous = self.step_s
        self.step_s = step_s if previous is None else previous + STEP_TIME_WEIGHT * (step_s - previous)

    def frames(self) -> int:
        """The first chunk's frames for a stream admitted now."""
        if self.shortest >= self.chunk_frames or self.safety == 0:
            return self.shortest
        step_s = (self.step_s or 0.0) * self.safety
        candidate = self.shortest
        while candidate < self.chunk_frames:
            if keeps_buffer(candidate, step_s, self.chunk_frames, self.window):
                return candidate
            candidate = (candidate // self.window + 1) * self.window  # the next window's end
        return self.chunk_frames
