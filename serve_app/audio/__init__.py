"""Pure audio code (no Ray import): streaming resampling and container encoding."""

from serve_app.audio.encoding import (
    CONTENT_TYPES,
    FORMATS,
    OPUS_SAMPLE_RATES_HZ,
    SAMPLE_RATES_HZ,
    AudioFormat,
    StreamEncoder,
    check_format_rate,
    float_to_pcm16,
    format_unavailable,
    playable,
    wav_stream_header,
)

__all__ = [
    "CONTENT_TYPES",
    "FORMATS",
    "OPUS_SAMPLE_RATES_HZ",
    "SAMPLE_RATES_HZ",
    "AudioFormat",
    "StreamEncoder",
    "check_format_rate",
    "float_to_pcm16",
    "format_unavailable",
    "playable",
    "wav_stream_header",
]
