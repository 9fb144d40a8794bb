"""One kernel, or the TTS audio window, alone on a GPU: int4 matmuls, the visible-ranges
attention kernel, the audio step's kernels."""
