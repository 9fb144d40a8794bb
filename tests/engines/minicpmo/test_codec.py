"""Codes -> audio: golden parity of DVAE + Vocos, batch invariance, and the streaming join."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from serve_app.engines.minicpmo.model.codec import (
    CODEBOOK_SIZE,
    CONTEXT_FRAMES,
    OVERLAP_SAMPLES,
    SAMPLES_PER_CODE_FRAME,
    SpeechDecoder,
    dvae_decode_keys,
    vocos_decode_keys,
)
from serve_app.engines.minicpmo.joiner import StreamingAudioJoiner
from tests.golden.checkpoint import load_expected

# Upstream carries the last 50 frames of a segment into the next one (``aid_len``).
CARRIED_FRAMES = 50


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Small convolutions on a busy 2-core box ran 10x slower with 2 spin-waiting OpenMP threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def speech_decoder(tiny_checkpoint: Path) -> SpeechDecoder:
    return SpeechDecoder.from_checkpoint(tiny_checkpoint)


def test_decode_keys_are_exactly_the_decoder_state_dicts(tiny_checkpoint: Path) -> None:
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as handle:
        dvae_keys = dvae_decode_keys(handle.keys())
    vocos_keys = vocos_decode_keys(torch.load(tiny_checkpoint / "assets" / "Vocos.pt",
                                              weights_only=True))
    decoder = SpeechDecoder()
    assert {key.removeprefix("tts.dvae.") for key in dvae_keys} == set(decoder.dvae.state_dict())
    assert not [key for key in dvae_keys if ".encoder." in key or "downsample_conv" in key]
    assert set(vocos_keys) == set(decoder.vocos.state_dict())


def test_codes_to_mel_and_audio_match_upstream(speech_decoder: SpeechDecoder) -> None:
    expected = load_expected("codec")
    codes = torch.from_numpy(expected["codes"])
    with torch.inference_mode():
        mel = speech_decoder.codes_to_mel(codes[None])
    np.testing.assert_allclose(mel.numpy(), expected["mel"], rtol=1e-4, atol=1e-5)
    wav = speech_decoder.decode([codes])[0]
    assert wav.dtype == torch.float32 and wav.shape == (len(codes) * SAMPLES_PER_CODE_FRAME,)
    np.testing.assert_allclose(wav.numpy(), expected["wav"], rtol=1e-4, atol=1e-5)


def test_bf16_decode_stays_within_its_documented_error_of_upstream(tiny_checkpoint: Path) -> None:
    """``decode_dtype: bfloat16`` (an opt-in for speed): the golden codes' waveform is 0.72%
    RMS off upstream's fp32 one on the tiny checkpoint (43 dB SNR; docs/benchmarks/README.md);
    fp32 is 5e-7 off. The bound leaves room for other CPUs' bf16 kernels, not for a broken cast."""
    expected = load_expected("codec")
    codes = torch.from_numpy(expected["codes"])
    decoder = SpeechDecoder.from_checkpoint(tiny_checkpoint).to(torch.bfloat16)
    wav = decoder.decode([codes])[0]
    assert wav.dtype == torch.float32
    reference = expected["wav"]
    error = np.sqrt(np.mean((wav.numpy() - reference) ** 2) / np.mean(reference ** 2))
    assert 1e-4 < error < 0.02  # bf16 did run (not fp32), and stayed close


def test_batched_decode_of_mixed_lengths_equals_decoding_alone(
        speech_decoder: SpeechDecoder) -> None:
    generator = torch.Generator().manual_seed(0)
    codes_list = [torch.randint(0, CODEBOOK_SIZE, (frames, 4), generator=generator)
                  for frames in (9, 4, 9, 1, 4, 9, 0)]
    batched = speech_decoder.decode(codes_list)
    for codes, wav in zip(codes_list, batched):
        alone = speech_decoder.decode([codes])[0]
        assert wav.shape == (len(codes) * SAMPLES_PER_CODE_FRAME,)
        torch.testing.assert_close(wav, alone, rtol=0, atol=1e-6)


def test_decode_refuses_codes_of_the_wrong_shape(speech_decoder: SpeechDecoder) -> None:
    with pytest.raises(ValueError, match=r"\[T, 4\]"):
        speech_decoder.decode([torch.zeros(5, 3, dtype=torch.long)])


def test_joiner_crossfades_the_context_with_weight_j_plus_1_over_2049() -> None:
    joiner = StreamingAudioJoiner()
    first = np.zeros(25 * SAMPLES_PER_CODE_FRAME, dtype=np.float32)
    emitted = joiner.push(first)
    assert len(emitted) == len(first) - OVERLAP_SAMPLES and joiner.held_samples == OVERLAP_SAMPLES
    second = np.ones((CONTEXT_FRAMES + 25) * SAMPLES_PER_CODE_FRAME, dtype=np.float32)
    emitted = joiner.push(second)
    assert len(emitted) == len(second) - OVERLAP_SAMPLES
    weights = np.arange(1, OVERLAP_SAMPLES + 1) / (OVERLAP_SAMPLES + 1)
    np.testing.assert_allclose(emitted[:OVERLAP_SAMPLES], weights, rtol=1e-6)
    np.testing.assert_array_equal(emitted[OVERLAP_SAMPLES:], 1.0)
    np.testing.assert_array_equal(joiner.finish(), 1.0)
    assert joiner.held_samples == 0


def test_joiner_rebuilds_a_signal_cut_into_overlapping_windows() -> None:
    signal = np.random.default_rng(0).standard_normal(137 * SAMPLES_PER_CODE_FRAME)
    signal = signal.astype(np.float32)
    joiner = StreamingAudioJoiner()
    outputs, frames_done = [], 0
    for frames_now in (2, 25, 50, 51, 53, 100, 137):  # 2: a first piece shorter than the context
        context = min(CONTEXT_FRAMES, frames_done)
        piece = signal[(frames_done - context) * SAMPLES_PER_CODE_FRAME:
                       frames_now * SAMPLES_PER_CODE_FRAME]
        assert joiner.held_samples == context * SAMPLES_PER_CODE_FRAME
        outputs.append(joiner.push(piece))
        frames_done = frames_now
    outputs.append(joiner.finish())
    np.testing.assert_allclose(np.concatenate(outputs), signal, rtol=1e-6, atol=1e-6)


def test_joiner_starts_a_new_segment_without_crossfade_and_checks_context() -> None:
    joiner = StreamingAudioJoiner()
    joiner.push(np.zeros(3000, dtype=np.float32))
    with pytest.raises(ValueError, match="context"):
        joiner.push(np.zeros(100, dtype=np.float32))
    assert len(joiner.finish()) == OVERLAP_SAMPLES
    fresh = np.ones(5000, dtype=np.float32)
    np.testing.assert_array_equal(joiner.push(fresh), fresh[:-OVERLAP_SAMPLES])
    joiner.reset()
    assert joiner.held_samples == 0 and len(joiner.finish()) == 0


def _upstream_pieces(expected: dict[str, np.ndarray]) -> list[tuple[torch.Tensor, bool]]:
    """Each generate call's codes to decode (with context) and whether it opens a segment.

    ``codes`` holds the segment's cumulative codes after every call; a new segment starts with
    the previous segment's last 50 frames, whose last 4 upstream decodes again as context.
    """
    offsets = np.concatenate([[0], np.cumsum(expected["call_code_lengths"])])
    calls = [torch.from_numpy(expected["codes"][start:end])
             for start, end in zip(offsets[:-1], offsets[1:])]
    pieces, frames_done, previous = [], 0, calls[0][:0]
    for codes in calls:
        new_segment = len(codes) < frames_done
        if new_segment:
            assert torch.equal(codes[:CARRIED_FRAMES], previous[-CARRIED_FRAMES:])
            frames_done = CARRIED_FRAMES
        pieces.append((codes[max(frames_done - CONTEXT_FRAMES, 0):], new_segment))
        frames_done, previous = len(codes), codes
    return pieces


@pytest.mark.parametrize("case", ["stream_short", "stream_medium", "stream_read", "stream_long"])
def test_streamed_decode_and_join_match_upstream_waveform(speech_decoder: SpeechDecoder,
                                                          case: str) -> None:
    expected = load_expected(case)
    pieces = _upstream_pieces(expected)
    audio = speech_decoder.decode([codes for codes, _ in pieces])  # one batch per piece length
    joiner = StreamingAudioJoiner()
    outputs = []
    for wav, (_, new_segment) in zip(audio, pieces):
        if new_segment:
            outputs.append(joiner.finish())
        outputs.append(joiner.push(wav))
    outputs.append(joiner.finish())
    np.testing.assert_allclose(np.concatenate(outputs), expected["wav"], rtol=1e-4, atol=1e-5)


def test_queued_decode_gives_each_piece_its_own_audio_whatever_the_lengths_around_it(
        speech_decoder: SpeechDecoder) -> None:
    """A step's pieces are decoded one batch per length (device.decode_graphs.queue_decode):
    each piece, in the step's order, gets the audio it gets decoded alone."""
    from serve_app.engines.minicpmo.device.decode_graphs import queue_decode

    generator = torch.Generator().manual_seed(7)
    lengths = [29, 7, 29, 3, 7, 25, 29]
    pieces = [torch.randint(0, 625, (n, 4), generator=generator) for n in lengths]
    frames = [[tuple(row) for row in piece.tolist()] for piece in pieces]  # as schedules hold them
    audio = queue_decode(speech_decoder, frames).wait()
    assert [len(a) for a in audio] == [n * 512 for n in lengths]
    for piece, got in zip(pieces, audio):
        alone = speech_decoder.decode([piece])[0].float().numpy()
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)
