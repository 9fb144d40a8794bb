"""Engine options from a plain mapping (``engine_options`` in serve_config.yaml), shared by the
engines' options dataclasses (pydantic dataclasses: names, types and values are checked)."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

T = TypeVar("T")


def options_from_raw(cls: type[T], raw: dict[str, Any]) -> T:
    """``cls(**raw)``; an unknown name is refused first, with the name it may have meant
    (``max_slot``: did you mean ``max_slots``?)."""
    known = list(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
                 for name in unknown for close in [difflib.get_close_matches(name, known, 1)]]
        raise ValueError(f"unknown engine options: {', '.join(hints)}; known: {', '.join(known)}")
    return cls(**raw)
