"""Text handling of the MiniCPM-o speech path (docs/minicpmo.md, "Prompts" and "Text pieces").

Pure functions with no model state: prompt building, cutting text into the pieces an LLM would
stream, digit normalisation (a piece's spoken form), sentence ends, cutting a segment's text at a
break and the TTS text layout.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from ..streamed_text import clause_ends

GENERATION_PROMPT = "<|im_end|>\n<|im_start|>assistant\n<|spk_bos|><|spk|><|spk_eos|><|tts_bos|>"
READ_INSTRUCTION = "Please read the text below.\n"
VOICE_INSTRUCTION = "Clone the voice in the provided audio prompt."  # upstream's voice-cloning turn
DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant. You can accept audio and text input and "
                         "output voice and text.")
TERMINATOR_TOKENS = ("<|im_end|>", "<|endoftext|>")
TTS_EOS_MARK = "<|tts_eos|>"
SENTENCE_ENDS = (".", "\u3002", "!", "?", "\uff01", "\uff1f")
PIECE_TOKENS = 3  # upstream decodes 3 LLM tokens per call; the TTS sees text at these boundaries

_CHINESE_DIGITS = dict(zip("0123456789", "零一二三四五六七八九"))
_ENGLISH_DIGITS = dict(zip("0123456789",
                           ("zero", "one", "two", "three", "four", "five", "six", "seven",
                            "eight", "nine")))


def user_turn(text: str, system_prompt: str | None = None) -> str:
    """The prefill text of a new session: the optional system prompt, then the user turn.

    Upstream (``get_sys_prompt``, rendered by the TTS chat template) puts its system prompts in a
    first turn of role ``user``, not ``system``; instructions follow that form.
    """
    prefix = f"<|im_start|>user\n{system_prompt}<|im_end|>\n" if system_prompt else ""
    return f"{prefix}<|im_start|>user\n{text}<|im_end|>\n"


def detect_language(text: str) -> str:
    """``"chinese"`` when CJK characters are at least as many as Latin letters."""
    cjk = len(re.findall(r"[\u4e00-\u9fff]", text))
    latin = len(re.findall(r"[a-zA-Z]", text))
    return "chinese" if cjk >= latin else "english"


def spell_digits(text: str, language: str) -> str:
    """Replace each run of digits, first occurrence first, by its digits spelled one by one."""
    for number in re.findall(r"\d+", text):
        if language == "chinese":
            spoken = "".join(_CHINESE_DIGITS[d] for d in number if d in _CHINESE_DIGITS)
        else:
            spoken = " ".join(_ENGLISH_DIGITS[d] for d in number if d in _ENGLISH_DIGITS)
        text = text.replace(number, spoken, 1)
    return text


def spoken_form(piece: str, language: str | None) -> str:
    """A piece as it is added to a segment's text after the first (digits spelled out in
    ``language``, English when None; no ``*``)."""
    return spell_digits(piece, language or "english").replace("*", "")


def cut_pieces(pieces: Sequence[tuple[str, str]], text: str, raw: str, after: str,
               language: str | None) -> tuple[str, str, str] | None:
    """Cut a segment's text before the last ``after`` characters of its ``pieces`` (each as
    received and as added to ``text``, :func:`spoken_form`; ``raw`` is the text as received):
    ``(text, raw, left)`` up to the cut, and what the cut leaves of ``text`` for the next
    segment. None when ``after`` is not where the pieces end, or the spoken form of the piece
    the cut splits (digits spelled in ``language``) does not split there."""
    if not after:
        return text, raw, ""
    index, tail = len(pieces), ""
    while len(tail) < len(after) and index > 0:
        index -= 1
        tail = pieces[index][0] + tail
    if not tail.endswith(after) or not raw.endswith(after):
        return None
    piece_raw, piece_added = pieces[index]
    split = len(tail) - len(after)  # within piece_raw: its part before the cut
    if piece_added == piece_raw:
        rest = piece_raw[split:]
    else:
        head = spoken_form(piece_raw[:split], language)
        rest = spoken_form(piece_raw[split:], language)
        if head + rest != piece_added:
            return None
    left = rest + "".join(added for _, added in pieces[index + 1:])
    if not text.endswith(left):
        return None
    return text[:len(text) - len(left)], raw[:len(raw) - len(after)], left


def sentence_end(piece: str) -> str:
    """The first sentence-end character (in upstream's order) found in ``piece``, or ``""``.

    A ``.`` whose first occurrence follows a digit (``1.``) does not count.
    """
    for mark in SENTENCE_ENDS:
        if mark in piece:
            if mark == ".":
                index = piece.find(mark)
                if index > 0 and piece[index - 1].isdigit():
                    continue
            return mark
    return ""


def complete_prefix_length(ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
    """How many leading ids decode without a trailing incomplete character (U+FFFD)."""
    end = len(ids)
    while end > 0 and decode(ids[:end]).endswith("\ufffd"):
        end -= 1
    return end


class PieceDecoder:
    """Turns LLM token ids, a few at a time, into text pieces as upstream streams them.

    Id 0 is dropped, a trailing terminator removed, and ids that end inside a multi-byte
    character are held back for the next piece.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], terminator_ids: Sequence[int]):
        self._decode = decode
        self._terminators = set(terminator_ids)
        self.held: list[int] = []

    def push(self, new_ids: Sequence[int]) -> str:
        ids = self.held + list(new_ids)
        end = complete_prefix_length(ids, self._decode) if ids else 0
        self.held = ids[end:]
        body = [i for i in ids[:end] if i != 0]
        if body and body[-1] in self._terminators:
            body = body[:-1]
        return self._decode(body) if body else ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end)."""
        held, self.held = self.held, []
        body = [i for i in held if i != 0 and i not in self._terminators]
        return self._decode(body) if body else ""


def cut_into_pieces(ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                    piece_tokens: int = PIECE_TOKENS) -> list[str]:
    """The pieces an LLM echoing ``ids`` would stream, ``piece_tokens`` tokens at a time."""
    decoder = PieceDecoder(decode, terminator_ids=())
    pieces = [decoder.push(ids[i:i + piece_tokens]) for i in range(0, len(ids), piece_tokens)]
    tail = decoder.flush()
    if tail:
        pieces.append(tail)
    return pieces


def has_speakable_text(text: str) -> bool:
    """True when the text holds at least one letter or digit of any script."""
    return any(ch.isalnum() for ch in text)


class TextFeed:
    """Read-mode text that arrives in parts, cut into the pieces :func:`cut_into_pieces` gives
    for the whole text.

    Text is tokenized only up to its last space that follows a non-space character: a
    byte-level BPE tokenizer never merges across that boundary, so the ids of the parts joined
    equal the ids of the whole. The trailing (possibly incomplete) word waits for more text or
    :meth:`finish`; ids wait until a whole piece of them is there.

    When the text stops coming, :meth:`break_point` and :meth:`cut_at_break` let the engine
    speak it up to its last break (``streamed_text.clause_ends``) without waiting for more.

    :attr:`tokens` counts the tokens of the text so far as it is tokenized (the stream's usage).
    """

    def __init__(self, tokenize: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], piece_tokens: int = PIECE_TOKENS) -> None:
        self._tokenize = tokenize
        self._decode = decode
        self._decoder = PieceDecoder(decode, terminator_ids=())
        self._piece_tokens = piece_tokens
        self._text = ""  # received, not yet tokenized
        self._ids: list[int] = []  # tokenized, not yet in a piece
        self._raw = ""  # received since the last cut at a break
        self.version = 0  # counts the pushes that brought text
        self.speakable = False  # some text so far holds a letter or a digit
        self.tokens = 0  # of the text tokenized so far (held-back text once it is tokenized)

    def push(self, text: str) -> list[str]:
        """Add text; returns the pieces that are now complete."""
        self._text += text
        self._raw += text
        self.version += bool(text)
        self.speakable = self.speakable or has_speakable_text(text)
        cut = _last_word_boundary(self._text)
        if cut:
            self._add_ids(self._tokenize(self._text[:cut]))
            self._text = self._text[cut:]
        return self._pieces(len(self._ids) - len(self._ids) % self._piece_tokens)

    def finish(self) -> list[str]:
        """The text is complete: its remaining pieces."""
        if self._text:
            self._add_ids(self._tokenize(self._text))
            self._text = ""
        pieces = self._pieces(len(self._ids))
        tail = self._decoder.flush()
        return pieces + [tail] if tail else pieces

    def break_point(self) -> tuple[str, str] | None:
        """Where the text received so far may be cut while more may still come: ``(held,
        given)``, the text held here up to its last break (to give out now as one piece) and the
        text already given out in pieces after that break (to move past the cut); None when
        there is no break, or the held text cannot be told apart from the given."""
        ends = clause_ends(self._raw)
        if not ends:
            return None
        held = self._decode(self._decoder.held + self._ids) + self._text
        if not self._raw.endswith(held):
            return None
        given = len(self._raw) - len(held)
        if ends[-1] >= given:
            return self._raw[given:ends[-1]], ""
        return "", self._raw[ends[-1]:given]

    def cut_at_break(self) -> None:
        """The engine cut the text at :meth:`break_point`: what was held before the break has
        gone out as a piece; what follows the break is held here, untokenized."""
        point = self.break_point()
        assert point is not None
        cut = clause_ends(self._raw)[-1]
        if point[0] or not point[1]:  # the break was in the held text
            # its ids are dropped: the piece before the break counts as itself, the text after
            # it when it is tokenized again
            self.tokens += (len(self._tokenize(point[0])) if point[0] else 0) - len(
                self._decoder.held) - len(self._ids)
            self._text = self._raw[cut:]
            self._ids = []
            self._decoder.held = []
        self._raw = self._raw[cut:]

    def _add_ids(self, ids: list[int]) -> None:
        self._ids += ids
        self.tokens += len(ids)

    def _pieces(self, count: int) -> list[str]:
        step = self._piece_tokens
        pieces = [self._decoder.push(self._ids[i:i + step]) for i in range(0, count, step)]
        self._ids = self._ids[count:]
        return pieces


class GrowingTextTokenizer:
    """Tokenizes a text that grows at its end, as a speech schedule's text does piece by piece,
    by encoding only what came after the last word boundary it has already encoded.

    A schedule tokenizes its whole text again after every piece (upstream's rule: the ids of
    the text so far). With BERT's normalizer and pre-tokenizer (the ChatTTS tokenizer's), no
    token spans a space, so the ids of ``a + " " + b`` are the ids of ``a`` and then those of
    ``" " + b``: the ids up to the last space that follows a non-space character are kept, and
    only the text after it is encoded (:func:`splits_at_spaces` says which tokenizers qualify).
    A text that does not extend the one before is encoded whole. At 1024 read streams on an H100
    the whole-text encodes took about a tenth of the engine's step (one read text: 23 encodes of
    up to 150 characters, ~70 us each), on the step thread.
    """

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode
        self._head = ""  # the text up to a word boundary, encoded
        self._head_ids: list[int] = []

    def __call__(self, text: str) -> list[int]:
        if not text.startswith(self._head):
            self._head, self._head_ids = "", []
        cut = _last_word_boundary(text)
        if cut > len(self._head):
            self._head_ids = self._head_ids + self._encode(text[len(self._head):cut])
            self._head = text[:cut]
        return self._head_ids + self._encode(text[len(self._head):])


def splits_at_spaces(backend: object) -> bool:
    """Whether a ``tokenizers`` tokenizer never makes a token across a space, so that
    :class:`GrowingTextTokenizer` gives its ids exactly: BERT's normalizer (per character) and
    pre-tokenizer (words split at whitespace and punctuation), with WordPiece."""
    from tokenizers import models, normalizers, pre_tokenizers

    return (isinstance(getattr(backend, "normalizer", None), normalizers.BertNormalizer)
            and isinstance(getattr(backend, "pre_tokenizer", None), pre_tokenizers.BertPreTokenizer)
            and isinstance(getattr(backend, "model", None), models.WordPiece))


def _last_word_boundary(text: str) -> int:
    """Index of the last space that follows a non-space character (0 if none)."""
    for index in range(len(text) - 1, 0, -1):
        if text[index] == " " and not text[index - 1].isspace():
            return index
    return 0
