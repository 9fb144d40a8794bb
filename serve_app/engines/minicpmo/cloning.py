"""Voice cloning's calls (docs/minicpmo.md, "Cloned voices"): a reference clip to its audio
embeddings, and embeddings to a registered voice whose voice turn's LLM keys and values are
computed once, when it is added. They run in the caller's thread, beside the step thread."""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from ..base import InvalidRequestError
from .model.audio_in import prepare_clip
from .model.loader import LoadedModel
from .voices import VoiceTable, VoiceTurn, check_voice_id, voice_turn

logger = logging.getLogger(__name__)


class VoiceCloner:
    """``MiniCPMOEngine``'s ``embed_voice``, ``add_voice`` and ``remove_voice``; with
    ``enabled`` false (no audio encoder, or ``voices`` off) each refuses."""

    def __init__(self, model: LoadedModel, runner, voices: VoiceTable, enabled: bool) -> None:
        self.model = model
        self._runner = runner
        self._voices = voices
        self.enabled = enabled
        # One clip or voice turn is computed at a time (in the caller's thread, beside the step
        # thread, on models the step thread only reads and caches of its own).
        self._work = threading.Lock()

    def embed(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        self.refuse_when_off()
        clip = prepare_clip(samples, sample_rate_hz)
        with self._work, torch.inference_mode():
            embeddings = self.model.clip_encoder.embed(clip)
            return embeddings.float().cpu().numpy()

    def add(self, voice_id: str, embeddings: np.ndarray) -> None:
        self.refuse_when_off()
        check_voice_id(voice_id)
        audio = self.check_embeddings(embeddings)
        self._voices.check_room(voice_id)
        turn = self.turn(len(audio))
        with self._work, torch.inference_mode():
            voice = self._runner.voice_prefix(voice_id, turn, torch.from_numpy(audio))
        dropped = self._voices.add(voice)
        logger.info("voice %s added (%d prompt tokens, %.1f MB of keys and values)%s", voice_id,
                    voice.length, voice.nbytes / 1e6,
                    f"; dropped {', '.join(dropped)}" if dropped else "")

    def remove(self, voice_id: str) -> None:
        self.refuse_when_off()
        self._voices.remove(check_voice_id(voice_id))

    def turn(self, audio_tokens: int) -> VoiceTurn:
        """The voice turn's token ids for ``audio_tokens`` embeddings, and their positions."""
        tok = self.model.tokenizer
        return voice_turn(lambda text: tok(text, add_special_tokens=False)["input_ids"],
                          tok.convert_tokens_to_ids, audio_tokens,
                          self.model.config.audio.tokens_per_chunk)

    def check_embeddings(self, embeddings: np.ndarray) -> np.ndarray:
        """``embeddings`` as contiguous float32 [T, LLM hidden], or ``invalid_embeddings``."""
        width, most = self.model.config.llm.hidden_size, self.model.config.audio.max_audio_tokens
        array = np.asarray(embeddings) if isinstance(embeddings, np.ndarray) else None
        if (array is None or array.ndim != 2 or array.dtype.kind != "f" or array.shape[1] != width
                or not 1 <= array.shape[0] <= most):
            raise InvalidRequestError(
                f"voice embeddings must be a float array [T, {width}] with 1 <= T <= {most} "
                "(what embed_voice returns)", "embeddings", code="invalid_embeddings")
        if not np.isfinite(array).all():
            raise InvalidRequestError("voice embeddings hold NaN or infinite values",
                                      "embeddings", code="invalid_embeddings")
        return np.ascontiguousarray(array, dtype=np.float32)

    def refuse_when_off(self) -> None:
        if not self.enabled:
            raise InvalidRequestError(
                "voice cloning is off in this engine (engine_options.voices is false, or the "
                "model has no audio encoder)", "voice", code="voice_cloning_off")
