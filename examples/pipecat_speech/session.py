"""The sessions of :class:`~.service.SpeechStreamTTSService` on ``WS /v1/audio/speech/stream``:
one socket and session per audio context, opened, its text ended or cancelled, and closed."""

from __future__ import annotations

import asyncio

from pipecat.frames.frames import EndFrame
from pipecat.services.tts_service import WebsocketTTSService
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from . import protocol


class StreamSessionService(WebsocketTTSService):
    """A ``WebsocketTTSService`` whose socket is one session of ``WS /v1/audio/speech/stream``,
    for one audio context: opened with ``session.start``, its text ended with
    ``input_text.done`` (or stopped with ``cancel``), closed by the service once it has
    answered. What goes through it, the text in and the audio out, is
    :class:`~.service.SpeechStreamTTSService`'s.
    """

    def __init__(self, *, url: str, api_key: str | None = None, **kwargs):
        """Args:
            url: The service's ``ws://.../v1/audio/speech/stream``.
            api_key: Sent as ``Authorization: Bearer``, where the service has keys.
            kwargs: ``WebsocketTTSService``'s.
        """
        super().__init__(**kwargs)
        self._url = url
        self._api_key = api_key
        self._receive_task: asyncio.Task | None = None
        # The audio context the open session speaks, and what is known of the session.
        self._session_context_id: str | None = None
        self._input_done = False
        self._session_answered = False  # response.done or response.cancelled came

    # ---- a session's text ends, or it is cancelled -----------------------------------------

    async def _end_input(self):
        if self._input_done or not self._session_open():
            return
        self._input_done = True
        try:
            await self._get_websocket().send(protocol.INPUT_TEXT_DONE)
        except ConnectionClosed:
            pass

    async def _cancel_session(self, played_s: float):
        if self._session_answered or not self._session_open():
            return
        self._input_done = True
        try:
            await self._get_websocket().send(protocol.cancel(played_s))
        except ConnectionClosed:
            pass

    # ---- sessions --------------------------------------------------------------------------

    def _session_open(self) -> bool:
        return self._websocket is not None and self._websocket.state is State.OPEN

    def _get_websocket(self):
        if self._websocket:
            return self._websocket
        raise ConnectionError(f"{self}: no session open")

    async def _open_session(self, context_id: str):
        self._session_context_id = context_id
        self._input_done = False
        self._session_answered = False
        await self._connect()

    async def _end_session(self):
        """End the open session: its text ends, its audio arrives, the service closes it."""
        if self._receive_task:
            await self._end_input()
            await asyncio.wait([self._receive_task])
            self._receive_task = None
        await self._disconnect_websocket()
        self._session_context_id = None

    async def stop(self, frame: EndFrame):
        # A graceful end lets the open session end as it would: its text is done and its
        # audio arrives, or a cancel it was sent is answered.
        await self._end_session()
        await super().stop(frame)

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()  # closing the socket cancels an unfinished session
        self._session_context_id = None

    async def _connect_websocket(self):
        """Open a socket and its session: ``session.start`` until ``session.started``."""
        websocket = None
        try:
            websocket = await self._websocket_connect(
                self._url, additional_headers=protocol.auth_headers(self._api_key), max_size=None)
            await protocol.start_session(websocket, self._settings.voice, self.sample_rate)
            self._websocket = websocket
            await self._call_event_handler("on_connected")
        except Exception as e:
            if websocket is not None:
                await websocket.close()
            self._websocket = None
            await self.push_error(error_msg=f"{self}: no session: {e}", exception=e)
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self):
        websocket, self._websocket = self._websocket, None
        if websocket is None:
            return
        try:
            await self.stop_all_metrics()
            await websocket.close()
        finally:
            await self._call_event_handler("on_disconnected")
