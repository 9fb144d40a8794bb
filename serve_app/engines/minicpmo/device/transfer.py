"""Copies between the host and the device that do not make the host wait for the device.

A plain PyTorch copy between CPU and CUDA memory (``t.to("cuda")``, ``torch.tensor(values,
device="cuda")``, ``t.cpu()``) synchronises the stream: the host waits until all work queued
before it has run. The step thread queues a step's decode and prepares the next step while the
GPU decodes, and launches an audio window and hands out the previous step's audio while the GPU
runs it; one such copy in that preparation would stall the host until the queued work ended.
These copies go through pinned memory instead: the host queues them and goes on. On the CPU they
are plain copies.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (CPU) on ``device``, queued after the device's work without waiting for it.

    The pinned staging block comes from PyTorch's caching host allocator, which does not hand
    it out again before the copy has run."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_tensor(values: Sequence, device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` without waiting for the device (:func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopy:
    """A device tensor on its way to host memory: the copy is queued on the current stream,
    after the work that makes the tensor, and :meth:`wait` returns the CPU tensor (its own
    buffer) once it has landed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            # a non-blocking copy to the CPU lands in pinned memory that PyTorch allocates
            self._host = tensor.to("cpu", non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = tensor

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host

