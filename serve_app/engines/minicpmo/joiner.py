"""One stream's decoded pieces joined into a gap-free waveform.

A leaf of the scheduling core: a :class:`~serve_app.engines.minicpmo.scheduler.Stream` holds
one, and :mod:`~serve_app.engines.minicpmo.output` pushes the decoded audio through it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .model.codec import OVERLAP_SAMPLES


@functools.lru_cache(maxsize=8)
def _fades(overlap: int) -> tuple[np.ndarray, np.ndarray]:
    """The crossfade's weights over ``overlap`` samples: the new piece's (j + 1) / (n + 1) and
    the held tail's 1 minus that (read-only: shared by every push)."""
    fade_in = np.arange(1, overlap + 1, dtype=np.float32) / np.float32(overlap + 1)
    fade_out = np.float32(1) - fade_in
    fade_in.flags.writeable = fade_out.flags.writeable = False
    return fade_in, fade_out


class StreamingAudioJoiner:
    """Joins one stream's decoded pieces into a gap-free waveform (docs/minicpmo.md,
    "Codes to audio").

    Contract, per TTS segment:

    - Piece k > 0 must start with the audio of the stream's last ``min(4, frames so far)``
      code frames re-decoded as context, i.e. exactly :attr:`held_samples` samples
      (2048 once the segment has 4 frames); the first piece has no context.
    - Those leading samples are crossfaded linearly with the held tail: the new piece's weight at
      overlap sample j of n is (j + 1) / (n + 1) (n = 2048: (j + 1) / 2049, as upstream).
    - :meth:`push` returns at once every sample that no later piece can change: all but the last
      ``min(2048, samples so far)`` of the joined stream. :meth:`finish` returns that held tail
      and starts a new segment: the next piece is emitted as is, without crossfade. (Upstream's
      first piece of a continuation segment re-decodes the 4 frames before it; they play twice.)
    - :meth:`reset` drops the held tail (abort) and starts a new segment.

    The concatenation of everything returned equals upstream's streamed waveform (up to float
    rounding of the crossfade), with less delay: upstream holds a whole piece back.
    """

    def __init__(self, overlap_samples: int = OVERLAP_SAMPLES) -> None:
        self.overlap_samples = overlap_samples
        self._tail = np.zeros(0, dtype=np.float32)

    @property
    def held_samples(self) -> int:
        """Samples held back, which the next piece must repeat as its leading context."""
        return len(self._tail)

    def push(self, piece: np.ndarray | torch.Tensor) -> np.ndarray:
        """Add a decoded piece (1-D float); returns the samples that are now final (float32)."""
        if isinstance(piece, torch.Tensor):
            piece = piece.detach().to("cpu", torch.float32).numpy()
        piece = np.asarray(piece, dtype=np.float32)
        if piece.ndim != 1:
            raise ValueError(f"piece must be 1-D, got shape {piece.shape}")
        overlap = len(self._tail)
        if len(piece) < overlap:
            raise ValueError(f"piece of {len(piece)} samples is shorter than its "
                             f"{overlap}-sample context")
        # one new array, the crossfade written into it in place (the engine joins hundreds of
        # pieces a step on its step thread): the same float32 products and sum as
        # tail x (1 - w) + piece x w
        joined = np.empty(len(piece), dtype=np.float32)
        if overlap:
            fade_in, fade_out = _fades(overlap)
            head = joined[:overlap]
            np.multiply(self._tail, fade_out, out=head)
            head += piece[:overlap] * fade_in
        joined[overlap:] = piece[overlap:]
        cut = max(len(joined) - self.overlap_samples, 0)
        self._tail = joined[cut:].copy()
        return joined[:cut]

    def finish(self) -> np.ndarray:
        """Return the held tail and start a new segment (next piece not crossfaded)."""
        tail, self._tail = self._tail, np.zeros(0, dtype=np.float32)
        return tail

    def reset(self) -> None:
        """Drop the held tail and start a new segment."""
        self._tail = np.zeros(0, dtype=np.float32)
