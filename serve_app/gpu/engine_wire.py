"""How messages cross between a synthesizer replica and its engine process.

A message is a pickled tuple. Its large buffers (numpy arrays: the audio of a step's chunks, a
voice clip, a voice's embeddings) are left out of the pickle (pickle protocol 5, out of band)
and travel as frames of their own, so the thread that pickles a message never copies the audio;
the thread that writes it gives up the GIL for every large write. On a
:class:`multiprocessing.connection.Connection`:

- one frame: the number of buffer frames that follow (4 bytes, little-endian), their sizes
  (8 bytes each), then the pickle;
- then each buffer, one frame each, in the order the pickle refers to them (received into
  writable memory, so the arrays on the other side are writable as well).

Pickling happens in the thread that makes the message (:func:`encode`); writing can happen in
another (:func:`send`), which is how the engine process keeps its step thread's hand-off cheap.
"""

from __future__ import annotations

import pickle
import struct
from multiprocessing.connection import Connection
from typing import NamedTuple

# Both processes of the wire run with this GIL switch interval (Python's default is 5 ms): a
# thread that comes back from a socket read or write, or the engine's step thread from a GPU
# sync, waits at most this long for the GIL (engine_process.py, engine_client.py).
GIL_SWITCH_INTERVAL_S = 0.001

_COUNT = struct.Struct("<I")
_SIZE = struct.Struct("<Q")


class Encoded(NamedTuple):
    """A pickled message and the buffers it left out, ready to write."""

    header: bytes
    buffers: list[pickle.PickleBuffer]


def encode(message: object) -> Encoded:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    sizes = b"".join(_SIZE.pack(buffer.raw().nbytes) for buffer in buffers)
    return Encoded(_COUNT.pack(len(buffers)) + sizes + body, buffers)


def send(conn: Connection, encoded: Encoded) -> None:
    conn.send_bytes(encoded.header)
    for buffer in encoded.buffers:
        conn.send_bytes(buffer.raw())


def send_message(conn: Connection, message: object) -> None:
    send(conn, encode(message))


def receive(conn: Connection) -> object:
    """The next message (raises EOFError or OSError when the other side is gone)."""
    header = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(header)
    buffers = []
    for index in range(count):
        (size,) = _SIZE.unpack_from(header, _COUNT.size + index * _SIZE.size)
        buffer = bytearray(size)
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    body = memoryview(header)[_COUNT.size + count * _SIZE.size:]
    return pickle.loads(body, buffers=buffers)
