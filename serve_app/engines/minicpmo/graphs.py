"""CUDA graph capture shared by the engine's step functions: one graph per batch bucket."""

from __future__ import annotations

from typing import Callable

import torch


def bucket_sizes(limit: int) -> list[int]:
    """Powers of two up to ``limit``, and ``limit`` itself."""
    return sorted({min(2 ** i, limit) for i in range(20) if 2 ** i < 2 * limit})


def capture_per_bucket(buckets: list[int], forward: Callable[[int], object]
                       ) -> dict[int, tuple[torch.cuda.CUDAGraph, object]]:
    """Warm ``forward(bucket)`` up on a side stream, then capture one graph per bucket.

    Graphs are captured largest first into one shared memory pool. Returns
    ``{bucket: (graph, output)}``; replaying a graph rewrites its output in place.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for bucket in buckets:
            forward(bucket)
    torch.cuda.current_stream().wait_stream(side)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
    pool = None
    with torch.inference_mode():
        for bucket in sorted(buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(bucket)
            pool = graph.pool()
            graphs[bucket] = (graph, out)
    torch.cuda.synchronize()
    return graphs
