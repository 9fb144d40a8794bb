"""The front: the one CPU deployment (HTTP, SSE, WebSocket) that checks each request once,
opens the synthesizer stream, encodes and ships the audio."""
