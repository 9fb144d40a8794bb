"""CUDA graph capture shared by the engine's step functions (one graph per batch bucket), and
the CUDA streams their replays run on."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def bucket_sizes(limit: int) -> list[int]:
    """Powers of two up to ``limit``, and ``limit`` itself."""
    return sorted({min(2 ** i, limit) for i in range(20) if 2 ** i < 2 * limit})


def row_bucket_sizes(limit: int, step: int = 64) -> list[int]:
    """Powers of two up to ``step``, then every ``step`` rows, up to ``limit`` itself: batch
    buckets for graphs whose rows are the streams that run (not a range of slots), so a batch
    is padded by at most ``step - 1`` rows where powers of two would pad 700 rows to 1024."""
    small = {min(2 ** i, limit) for i in range(20) if 2 ** i <= step}
    return sorted(small | set(range(2 * step, limit, step)) | {limit})


def gathered_slots(slots: list[int], bucket: int) -> torch.Tensor:
    """The slot of each of a gathered graph's ``bucket`` rows: the streams' in order, then the
    first stream's for the padding rows (inactive: they write only its scratch position)."""
    order = torch.full((bucket,), slots[0], dtype=torch.long)
    order[:len(slots)] = torch.tensor(slots)
    return order


def shortest_span(spans: list[int], last: int) -> int:
    """The shortest of ``spans`` (ascending key counts a set of graphs is captured for) that
    holds position ``last``; the longest (the whole cache) if none does."""
    return next((span for span in spans if span > last), spans[-1])


def separate_capture_stream(*others: torch.cuda.Stream) -> torch.cuda.Stream:
    """A capture stream for graphs that replay *while* graphs captured the default way run.

    cuBLAS (and cuBLASLt) pick their workspace per stream, and a captured matmul bakes in the
    workspace of the stream it was captured on (torch 2.11; pytorch/pytorch#193402). Graphs
    captured on one stream therefore share one workspace, and two of them replayed at the same
    time on two streams run matmuls that scribble over each other's workspace: on an H100 the
    engine's overlapped LLM step hung its audio window that way (docs/benchmarks/README.md,
    "The overlapped chat LLM step"). Streams come from a small pool that torch hands out in
    turn, so this takes the first that is not the default capture stream (nor one of
    ``others``: capture streams of graphs that replay beside these).
    """
    default = torch.cuda.graph.default_capture_stream
    if default is None:  # made with the first graph; make it now so the two differ
        torch.cuda.graph(torch.cuda.CUDAGraph())
        default = torch.cuda.graph.default_capture_stream
    taken = {default.cuda_stream, *(other.cuda_stream for other in others)}
    for _ in range(256):
        stream = torch.cuda.Stream()
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError("no CUDA stream other than the default capture stream")


class FirstInLine:
    """A CUDA stream of the device's highest priority (torch maps -100 to it) for work that
    must not wait behind kernels on other streams: :meth:`queue` runs a block's work on it,
    after the current stream's work so far and before what the current stream gets next, so
    only work on other streams (an LLM step launched beside it) runs beside it and gets the SMs
    it leaves, not the other way round."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=-100)

    @contextlib.contextmanager
    def queue(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)


def capture_per_bucket(buckets: list[int], forward: Callable[[int], object],
                       capture_stream: torch.cuda.Stream | None = None, pool: object = None
                       ) -> dict[int, tuple[torch.cuda.CUDAGraph, object]]:
    """Warm ``forward(bucket)`` up on a side stream, then capture one graph per bucket.

    Graphs are captured largest first into one shared memory pool (``pool``, a graph's
    ``pool()``, to share one with graphs captured before: only for graphs that never replay at
    the same time), on ``capture_stream`` (default: torch's default capture stream; see
    :func:`separate_capture_stream` for graphs that run beside others). Returns
    ``{bucket: (graph, output)}``; replaying a graph rewrites its output in place.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for bucket in buckets:
            forward(bucket)
    torch.cuda.current_stream().wait_stream(side)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
    with torch.inference_mode():
        for bucket in sorted(buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                out = forward(bucket)
            pool = graph.pool()
            graphs[bucket] = (graph, out)
    torch.cuda.synchronize()
    return graphs
