"""The one text rule every route and engine applies to the text it is asked to speak.

What is **kept**: every letter, mark, number, punctuation sign and symbol of every script (emoji
included), spaces of every kind, newline and tab, and the zero-width joiner and non-joiner
(U+200D, U+200C) where they sit between two letters, marks or symbols (emoji sequences, Persian
and Indic spelling need them).

What is **removed**: C0 and C1 control characters but newline, tab and NUL, lone surrogates,
private-use and unassigned code points, and format characters (zero-width spaces,
bidirectional controls, the byte order mark, soft hyphens, joiners that join nothing): they
carry no sound, and some break engines. A control that is whitespace (carriage return, vertical
tab, form feed, the separators U+001C-U+001F, U+0085) becomes a space, so the words around it
stay apart.

What is **refused** (:class:`InvalidRequestError`, before anything is scheduled), in this order:
text holding a NUL (``invalid_text``: no text holds one, so the client sent something else, and
dropping it would glue ``"Hello\u0000world"`` into one word; it also ends a C string inside
espeak-ng); text longer than the limit once cleaned (``text_too_long``); text with nothing left
to speak, i.e. no letter, mark, number, punctuation or symbol (``nothing_to_speak``). An engine
may refuse more with that code when it can voice less (see each engine's ``validate``).

Pure functions, no framework imports: the ingress, the engines and ``SpeechRequest`` itself call
them, so the rule is written once.
"""

from __future__ import annotations

import unicodedata

from serve_app.engines.errors import InvalidRequestError

# The longest text (characters, after cleaning) an engine accepts; api.max_input_chars may not
# exceed it.
MAX_TEXT_CHARS = 4096

NOTHING_TO_SPEAK = "nothing_to_speak"
TEXT_TOO_LONG = "text_too_long"
INVALID_TEXT = "invalid_text"

_NUL = "\x00"
_KEPT_CONTROLS = frozenset("\n\t" + _NUL)  # NUL stays for check_text to refuse
_JOINERS = frozenset("\u200c\u200d")


def _can_be_joined(char: str) -> bool:
    return unicodedata.category(char)[0] in "LMS"


def _joins_something(text: str, index: int) -> bool:
    return (0 < index < len(text) - 1 and _can_be_joined(text[index - 1])
            and _can_be_joined(text[index + 1]))


def _cleaned_char(text: str, index: int) -> str:
    """What one character that ``str.isprintable`` refuses becomes: itself, a space, or ''."""
    char = text[index]
    category = unicodedata.category(char)
    if char in _KEPT_CONTROLS or category[0] == "Z":
        return char
    if category == "Cc":
        return " " if char.isspace() else ""
    if char in _JOINERS and _joins_something(text, index):
        return char
    return ""  # other format characters (Cf), surrogates (Cs), private use (Co), unassigned (Cn)


def clean_text(text: str) -> str:
    """The text under the rule: removed characters dropped, whitespace controls made spaces.

    Idempotent; text with nothing to remove (the usual case) is returned as it is. A NUL is
    kept, so that :func:`check_text` refuses it wherever it is called.
    """
    if text.isprintable():  # no control, format, surrogate, private or unassigned character
        return text
    return "".join(char if char.isprintable() else _cleaned_char(text, index)
                   for index, char in enumerate(text))


def has_something_to_speak(text: str) -> bool:
    """True when the text holds a letter, mark, number, punctuation sign or symbol."""
    return any(char.isprintable() and not char.isspace() for char in clean_text(text))


def check_text(text: str, max_chars: int = MAX_TEXT_CHARS, param: str = "text") -> str:
    """The cleaned text, or :class:`InvalidRequestError` (``invalid_text``, ``text_too_long``,
    ``nothing_to_speak``).

    ``param`` names the request field in the error (``input`` on the OpenAI route).
    """
    cleaned = clean_text(text)
    if _NUL in cleaned:
        raise InvalidRequestError(f"{param} holds a NUL character (U+0000): send text, not "
                                  "binary data or a C string", param=param, code=INVALID_TEXT)
    if len(cleaned) > max_chars:
        raise InvalidRequestError(f"{param} is longer than {max_chars} characters", param=param,
                                  code=TEXT_TOO_LONG)
    if not has_something_to_speak(cleaned):
        raise InvalidRequestError(
            f"{param} holds nothing to speak: no letter, number, punctuation or symbol is left "
            "once control, format and unassigned characters are removed", param=param,
            code=NOTHING_TO_SPEAK)
    return cleaned
