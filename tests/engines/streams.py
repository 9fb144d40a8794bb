"""Helpers for tests that read engine streams."""

from __future__ import annotations


async def drain(stream) -> tuple[int, BaseException | None]:
    """Read a stream to its end: how many chunks came, and the error that ended it (if any)."""
    chunks = 0
    try:
        async for _ in stream:
            chunks += 1
    except Exception as exc:
        return chunks, exc
    return chunks, None
