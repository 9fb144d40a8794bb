"""A Pipecat TTS service that speaks through ``WS /v1/audio/speech/stream``, and a speaker that
plays into a file: the parts of ``examples/pipecat_tts.py`` (which runs them as a script).

- :mod:`.service`: :class:`SpeechStreamTTSService`, the Pipecat 1.14 ``WebsocketTTSService``.
- :mod:`.protocol`: the WebSocket's messages as the service sends them (no Pipecat).
- :mod:`.timeline`: :class:`ListenerTimeline`, when the listener hears a session's audio.
- :mod:`.speaker`: :class:`PcmFileOutputTransport`, a speaker that plays into a raw PCM file.
"""

from .service import SpeechStreamTTSService
from .speaker import PcmFileOutputTransport

__all__ = ["PcmFileOutputTransport", "SpeechStreamTTSService"]
