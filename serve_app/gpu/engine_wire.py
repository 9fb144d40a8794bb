"""How messages cross between a synthesizer replica and its engine process.

A message is a pickled tuple. Its large buffers (numpy arrays: the audio of a step's chunks, a
voice clip, a voice's embeddings) are left out of the pickle (pickle protocol 5, out of band),
so the thread that pickles a message never copies the audio. Each message is one frame on a
stream socket (the replica and its engine process hold the two ends of a socket pair):

- the pickle's size, the number of buffers and the clock reading (``time.perf_counter``, one
  clock for the host's processes) when the sender began writing it (``<QId``, little-endian):
  with the sink's reading in the message, it splits a chunk's way into the wait for the sender
  and the write and read;
- each buffer's size (8 bytes each);
- the pickle, then every buffer, in the order the pickle refers to them.

The sender writes the whole frame in one gathering write (``sendmsg``) straight from the arrays:
nothing is joined or copied on its side. The receiver reads the two small heads, allocates one
array per buffer and reads the pickle and all the buffers in one scattering read that waits for
all of it (``recvmsg_into`` with ``MSG_WAITALL``): the kernel copies each chunk's samples
straight into the array the chunk will hold (writable, its own memory, so keeping one chunk
keeps nothing else alive), and however many times the socket's buffer fills and drains while a
step's megabytes cross, each side comes back for the GIL a few times per message, not once per
buffer-full (each time a thread comes back from the kernel it may wait up to the switch
interval for the GIL).

Not one buffer for a whole step with each chunk a view of it: every layer that relays a stream
(the Synthesizer's generators, Serve's) holds its last chunk until the next one comes, so a
stream idle between chunks (a voice agent's, waiting for text) would keep a whole step's audio
alive. Not int16 on the wire: the front resamples and encodes float samples, so every format
but 24 kHz pcm and wav would change, and the conversion costs the engine's step thread more
than the sink's whole hand-off (``scripts/bench_engine_wire.py``).

Pickling happens in the thread that makes the message (:func:`encode`); writing can happen in
another (:func:`send`), which is how the engine process keeps its step thread's hand-off cheap.
"""

from __future__ import annotations

import pickle
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

# Both processes of the wire run with this GIL switch interval (Python's default is 5 ms): a
# thread that comes back from a socket read or write, or the engine's step thread from a GPU
# sync, waits at most this long for the GIL (engine_process.py, engine_client.py).
GIL_SWITCH_INTERVAL_S = 0.001

_PREFIX = struct.Struct("<QId")  # pickle bytes, buffer count, when the sender began writing
_SIZE = struct.Struct("<Q")
# At most this many pieces per sendmsg or recvmsg_into (Linux's IOV_MAX is 1024).
_MAX_PIECES = 512


class Encoded(NamedTuple):
    """A pickled message and the buffers it left out, ready to write (the frame's prefix is
    packed when it is written)."""

    body_bytes: int
    header: bytes  # the buffers' sizes, then the pickle
    buffers: list[pickle.PickleBuffer]


def encode(message: object) -> Encoded:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    sizes = b"".join(_SIZE.pack(buffer.raw().nbytes) for buffer in buffers)
    return Encoded(len(body), sizes + body, buffers)


def send(sock: socket.socket, encoded: Encoded) -> None:
    prefix = _PREFIX.pack(encoded.body_bytes, len(encoded.buffers), time.perf_counter())
    views = [memoryview(prefix), memoryview(encoded.header)]
    views += [buffer.raw() for buffer in encoded.buffers]
    views = [view for view in views if view.nbytes]
    while views:  # a signal may cut a blocking sendmsg short
        views = _after(views, sock.sendmsg(views[:_MAX_PIECES]))


def send_message(sock: socket.socket, message: object) -> None:
    send(sock, encode(message))


def receive(sock: socket.socket) -> object:
    """The next message (raises EOFError or OSError when the other side is gone)."""
    return receive_timed(sock)[0]


def receive_timed(sock: socket.socket) -> tuple[object, float]:
    """The next message and when its sender began writing it (``time.perf_counter``)."""
    prefix = bytearray(_PREFIX.size)
    _read_all(sock, [memoryview(prefix)])
    body_bytes, count, sending_at_s = _PREFIX.unpack(prefix)
    sizes = bytearray(count * _SIZE.size)
    _read_all(sock, [memoryview(sizes)])
    body = bytearray(body_bytes)
    buffers = [np.empty(size, np.uint8) for (size,) in _SIZE.iter_unpack(sizes)]
    _read_all(sock, [memoryview(body)] + [memoryview(buffer) for buffer in buffers])
    return pickle.loads(body, buffers=buffers), sending_at_s


def _read_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every one of ``views`` from ``sock``, in order; EOFError if it closes first."""
    views = [view for view in views if view.nbytes]
    while views:  # one call unless a signal cuts it short
        read = sock.recvmsg_into(views[:_MAX_PIECES], 0, socket.MSG_WAITALL)[0]
        if read == 0:
            raise EOFError("the other side closed the socket")
        views = _after(views, read)


def _after(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` without their first ``nbytes`` bytes."""
    index = 0
    while index < len(views) and nbytes >= views[index].nbytes:
        nbytes -= views[index].nbytes
        index += 1
    rest = views[index:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest
