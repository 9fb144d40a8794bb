"""One step of the Piper engine, run on its worker thread: phonemize what each chosen stream
has pending, take its next piece, and synthesize the pieces as padded ONNX batches (one per
set of scales; rows cut back to their own lengths by ``synthesize_batch``)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable


from serve_app.engines.piper.piper_stream import PieceAudio, PiperStream
from serve_app.engines.piper.piper_text import Phonemizer, Scales
from serve_app.engines.piper.piper_voice import Synthesized
from serve_app.engines.piper.piper_words import Piece, word_samples

logger = logging.getLogger(__name__)

StepResult = PieceAudio | None | BaseException  # None: the stream has nothing (left) to say
SynthesizeRows = Callable[[list, Scales], list[Synthesized]]


def take_pieces(streams: list[PiperStream], phonemizer: Phonemizer,
                results: list[StepResult]) -> dict[Scales, list[tuple[int, Piece]]]:
    """Each stream's next piece, grouped by scales as (index in ``streams``, piece); a stream
    whose text fails to phonemize gets its exception in ``results``."""
    groups: dict[Scales, list[tuple[int, Piece]]] = {}
    for index, stream in enumerate(streams):
        words = stream.request.word_times
        try:
            if stream.pieces is None:
                text = stream.request.text
                stream.pieces = deque(phonemizer.word_pieces(text) if words
                                      else phonemizer.pieces(text))
            if stream.fed is not None:
                for clause in stream.fed.clauses:
                    first = not stream.started and not stream.pieces
                    with phonemizer.lock:
                        stream.pieces.extend(phonemizer.phonemize(clause, first, words))
                stream.fed.clauses = []
            if stream.pieces:
                groups.setdefault(stream.scales, []).append((index, stream.pieces.popleft()))
        except Exception as exc:  # one bad text must not fail the others
            results[index] = exc
    return groups


def synthesize_rows_or_each(synthesize_rows: SynthesizeRows, rows: list, scales: Scales
                            ) -> list[Synthesized | BaseException]:
    """One padded batch; if it fails, each row alone (a row that still fails gets its error)."""
    try:
        return synthesize_rows(rows, scales)
    except Exception:
        logger.exception("batched synthesis failed; retrying rows one by one")
    audios: list[Synthesized | BaseException] = []
    for ids in rows:
        try:
            audios.append(synthesize_rows([ids], scales)[0])
        except Exception as exc:
            audios.append(exc)
    return audios


def run_step(streams: list[PiperStream], phonemizer: Phonemizer,
             synthesize_rows: SynthesizeRows) -> list[StepResult]:
    """Next piece of each stream, in the order of ``streams``."""
    results: list[StepResult] = [None] * len(streams)
    for scales, rows in take_pieces(streams, phonemizer, results).items():
        audios = synthesize_rows_or_each(synthesize_rows, [piece.ids for _, piece in rows],
                                         scales)
        for (index, piece), audio in zip(rows, audios):
            if isinstance(audio, BaseException):
                results[index] = audio
            else:
                words = (word_samples(piece.words, audio.id_samples)
                         if piece.words and audio.id_samples is not None else ())
                results[index] = PieceAudio(audio.samples, words)
    return results
