"""Texts the load test speaks: short (one sentence), medium (a few), long (a paragraph).

Lengths mirror what listeners send: short replies dominate, paragraphs are rarer and hold a
stream for tens of seconds. ``pick`` draws a length class by weight, then a text of that class.
"""

from __future__ import annotations

import random

SHORT = (
    "Hello from the serving stack.",
    "Your order has shipped and will arrive on Tuesday.",
    "The meeting starts in five minutes.",
    "Turn left at the next intersection.",
    "It is sunny and twenty two degrees outside.",
    "Thanks for calling, how can I help you today?",
)

MEDIUM = (
    ("Streaming speech lets a listener hear the first words while the rest is still being "
     "made. The service splits the text into sentences and sends each one as soon as it is "
     "ready."),
    ("Your appointment with the dentist is confirmed for Thursday at half past nine. Please "
     "arrive ten minutes early and bring your insurance card. Call us if you need to change it."),
    ("The train to the airport leaves from platform four every twenty minutes. Tickets are "
     "sold at the machines near the entrance, and the ride takes about half an hour."),
    ("Today's forecast calls for light rain in the morning, clearing by noon. Temperatures "
     "will reach eighteen degrees, with a gentle breeze from the west in the afternoon."),
)

LONG = (
    ("A load test tells you two things that a single request never will: how many listeners "
     "one machine can serve at once, and how long the unlucky ones wait for the first sound. "
     "The second number matters more than it seems. A player that starts late feels broken "
     "even when the rest of the audio arrives quickly, so the tail of the time to first byte "
     "is what users remember. Throughput, on the other hand, decides the bill: every stream "
     "a replica can hold in real time is one less replica to pay for. This paragraph is long "
     "on purpose, so that some streams stay open for many seconds while others come and go."),
    ("The old lighthouse stood at the end of a narrow path that wound between the dunes. Each "
     "evening the keeper climbed the spiral stairs, polished the great lens, and lit the lamp "
     "that swept its beam across the water. Ships far out at sea counted the flashes to know "
     "where they were. When the lamp was finally replaced by an automatic light, the keeper "
     "stayed on in the cottage below, and visitors still found him on the gallery at dusk, "
     "watching the beam turn as if he were the one keeping it alive."),
)

# chat mode: the model answers these, so the spoken length is the model's, not the prompt's.
CHAT = (
    "What is a good name for a grey cat?",
    "Give me one tip for sleeping better.",
    "Describe the sea in two sentences.",
    "Why is the sky blue? Answer briefly.",
)

TEXTS: dict[str, tuple[str, ...]] = {"short": SHORT, "medium": MEDIUM, "long": LONG}
DEFAULT_MIX: dict[str, float] = {"short": 5.0, "medium": 3.0, "long": 1.0}


def parse_mix(spec: str | None) -> dict[str, float]:
    """``"short=5,medium=3,long=1"`` -> weights; an empty spec gives the default mix."""
    if not spec:
        return dict(DEFAULT_MIX)
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in TEXTS:
            raise ValueError(f"unknown text length {name!r}; known: {', '.join(TEXTS)}")
        mix[name] = float(weight)
    if not any(weight > 0 for weight in mix.values()):
        raise ValueError(f"text mix {spec!r} has no positive weight")
    return mix


def pick(mix: dict[str, float], rng: random.Random) -> tuple[str, str]:
    """A (length class, text) pair drawn by the mix's weights."""
    names = list(mix)
    length = rng.choices(names, weights=[mix[name] for name in names])[0]
    return length, rng.choice(TEXTS[length])
