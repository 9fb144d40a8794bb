"""How messages cross between a synthesizer replica and its engine process.

A message is a pickled tuple. Its large buffers (numpy arrays: the audio of a step's chunks, a
voice clip, a voice's embeddings) are left out of the pickle (pickle protocol 5, out of band),
so the thread that pickles a message never copies the audio. Each message is one frame on a
stream socket (the replica and its engine process hold the two ends of a socket pair):

- the pickle's size, the number of buffers, the clock reading (``time.perf_counter``, one
  clock for the host's processes) when the sender began writing it, and where the buffers are
  in the :class:`AudioRing` (``IN_FRAME``: in this frame) (``<QIdQ``, little-endian); with the
  sink's reading in the message, the clock splits a chunk's way into the wait for the sender
  and the crossing;
- each buffer's size (8 bytes each);
- the pickle, then every buffer (unless they are in the ring), in the order the pickle refers
  to them.

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
than the sink's whole hand-off (``bench/engine/wire.py``).

Pickling happens in the thread that makes the message (:func:`encode`); writing can happen in
another (:func:`send`), which is how the engine process keeps its step thread's hand-off cheap.

From the engine process to its replica the buffers go through an :class:`AudioRing` where it has
room: shared memory both processes map, so the socket carries only the frame's head and pickle,
and the reader copies each buffer out of the ring into an array of its own: a step's megabytes
take no trips through the kernel. At read 736 on an H100 a first chunk's crossing (the sender's
start to the reader's end) was 21.7 / 53.2 ms p50 / p99 through the socket and 18.8 / 34.7 ms
through the ring, in runs on two machines (docs/benchmarks/README.md, "Current"). A message
whose buffers do not fit the ring's free space crosses the socket as before: the sender never
waits for the reader and never overwrites what it has not read.
"""

from __future__ import annotations

import mmap
import os
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

# pickle bytes, buffer count, when the sender began writing, where in the ring the buffers are
# (an absolute byte position; IN_FRAME: in the frame, after the pickle)
_PREFIX = struct.Struct("<QIdQ")
IN_FRAME = (1 << 64) - 1
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


class AudioRing:
    """Shared memory (a memfd) that one sender writes messages' buffers into and one reader
    copies them out of, in order. Positions are absolute byte counts: the sender's next one
    lives in its process, the reader's count of bytes done in the ring's first 8 bytes, which
    only the reader writes (an aligned 8-byte store: whole on x86-64 and ARM64). The socket
    frame that names a position is written after its buffers, so the reader never sees a
    position before its bytes."""

    HEAD_BYTES = 64

    def __init__(self, fd: int, capacity: int) -> None:
        self.fd = fd
        self.capacity = capacity
        # mapped with its pages in place (Linux), so no write or read of a step takes page faults
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, self.HEAD_BYTES + capacity, flags=flags)
        self._data = memoryview(self._map)[self.HEAD_BYTES:]
        self._next = 0  # the sender's next free position

    @classmethod
    def create(cls, capacity: int) -> "AudioRing":
        fd = os.memfd_create("engine-audio-ring")
        os.ftruncate(fd, cls.HEAD_BYTES + capacity)
        return cls(fd, capacity)

    def _done(self) -> int:
        return _SIZE.unpack_from(self._map, 0)[0]

    @property
    def bytes_taken(self) -> int:
        """Bytes the reader has copied out (and skipped at the ring's end) so far."""
        return self._done()

    def put(self, buffers: list[memoryview]) -> int | None:
        """Copy ``buffers`` into the ring, one after another; their start position, or None
        when the unread bytes leave no room for them (nothing is written then)."""
        total = sum(view.nbytes for view in buffers)
        start = self._next
        if start % self.capacity + total > self.capacity:  # no wrapping inside a message
            start += self.capacity - start % self.capacity
        if total > self.capacity or start + total - self._done() > self.capacity:
            return None
        offset = start % self.capacity
        for view in buffers:  # memcpy with the GIL held: one hold, not one wait per buffer
            self._data[offset:offset + view.nbytes] = view
            offset += view.nbytes
        self._next = start + total
        return start

    def take(self, start: int, sizes: list[int]) -> list[np.ndarray]:
        """Copies of the buffers of ``sizes`` bytes from ``start`` on; their room is free
        again."""
        offset = start % self.capacity
        buffers = []
        for size in sizes:
            buffer = np.empty(size, np.uint8)
            memoryview(buffer)[:] = self._data[offset:offset + size]  # memcpy, GIL held
            buffers.append(buffer)
            offset += size
        _SIZE.pack_into(self._map, 0, start + sum(sizes))
        return buffers

    def close(self) -> None:
        self._data.release()
        self._map.close()
        os.close(self.fd)


def send(sock: socket.socket, encoded: Encoded, ring: AudioRing | None = None) -> None:
    buffers = [buffer.raw() for buffer in encoded.buffers]
    start = ring.put(buffers) if ring is not None and buffers else None
    prefix = _PREFIX.pack(encoded.body_bytes, len(encoded.buffers), time.perf_counter(),
                          IN_FRAME if start is None else start)
    views = [memoryview(prefix), memoryview(encoded.header)]
    if start is None:
        views += buffers
    views = [view for view in views if view.nbytes]
    while views:  # a signal may cut a blocking sendmsg short
        views = _after(views, sock.sendmsg(views[:_MAX_PIECES]))


def send_message(sock: socket.socket, message: object) -> None:
    send(sock, encode(message))


def receive(sock: socket.socket, ring: AudioRing | None = None) -> object:
    """The next message (raises EOFError or OSError when the other side is gone)."""
    return receive_timed(sock, ring)[0]


def receive_timed(sock: socket.socket, ring: AudioRing | None = None) -> tuple[object, float]:
    """The next message and when its sender began writing it (``time.perf_counter``); its
    buffers come from ``ring`` where the sender put them there."""
    prefix = bytearray(_PREFIX.size)
    _read_all(sock, [memoryview(prefix)])
    body_bytes, count, sending_at_s, start = _PREFIX.unpack(prefix)
    sizes = bytearray(count * _SIZE.size)
    _read_all(sock, [memoryview(sizes)])
    body = bytearray(body_bytes)
    lengths = [size for (size,) in _SIZE.iter_unpack(sizes)]
    if start == IN_FRAME:
        buffers = [np.empty(size, np.uint8) for size in lengths]
        _read_all(sock, [memoryview(body)] + [memoryview(buffer) for buffer in buffers])
    else:
        if ring is None:
            raise OSError("a message's buffers are in a ring this end does not map")
        _read_all(sock, [memoryview(body)])
        buffers = ring.take(start, lengths)
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
