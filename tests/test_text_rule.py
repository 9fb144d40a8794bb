"""The one text rule (serve_app/engines/text_rule.py): what is kept, removed and refused, for any text."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import example, given, settings

from serve_app.engines.base import InvalidRequestError, SpeechRequest
from serve_app.engines.text_rule import MAX_TEXT_CHARS, check_text, clean_text
from tests.text_cases import ONCE_FAILED, SPEAKS, hostile_text

# Pure functions: many examples cost little. derandomize: the same examples on every run.
RULE_SETTINGS = settings(max_examples=600, derandomize=True, database=None, deadline=None)
JOINERS = "\u200c\u200d"


def speakable_category(char: str) -> bool:
    return unicodedata.category(char)[0] in "LMNPS"


def kept_as_is(char: str) -> bool:
    return speakable_category(char) or unicodedata.category(char)[0] == "Z" or char in "\n\t\0"


def outcome(text: str) -> str:
    try:
        check_text(text)
    except InvalidRequestError as error:
        return error.code
    return "speaks"


@pytest.mark.parametrize(("text", "code"), [
    ("\u0000\u0001\u0002", "invalid_text"),
    ("Hello\u0000world", "invalid_text"),
    ("\u200b\u200b\u200b", "nothing_to_speak"),
    (" \t\u0007 ", "nothing_to_speak"),
    ("", "nothing_to_speak"),
    (" \n\t ", "nothing_to_speak"),
    ("\U000c4a7e\ue000\ud800\u202e\ufeff", "nothing_to_speak"),
    ("x" * (MAX_TEXT_CHARS + 1), "text_too_long"),
])
def test_the_reported_texts_are_refused_with_a_stable_code(text: str, code: str) -> None:
    assert outcome(text) == code


@pytest.mark.parametrize("text", SPEAKS + ["x\u200b" * MAX_TEXT_CHARS])
def test_every_script_emoji_punctuation_and_markup_is_kept(text: str) -> None:
    assert check_text(text) == clean_text(text)
    assert outcome(text) == "speaks"


def test_what_is_removed_and_what_becomes_a_space() -> None:
    assert clean_text("Hel\u00adlo\u200b \u202eworld\u202c\ufeff") == "Hello world"
    assert clean_text("one\r\ntwo\u000bthree\u0085four\u001ffive") == "one \ntwo three four five"
    assert clean_text("bell\u0007 esc\u001b[1m del\u007f") == "bell esc[1m del"
    # Joiners stay where they join: an emoji family, a Persian word; elsewhere they go.
    family = "\U0001F468\u200d\U0001F469\u200d\U0001F467"
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"
    assert clean_text(family) == family and clean_text(persian) == persian
    assert clean_text("\u200dHi\u200c \u200d") == "Hi "


@RULE_SETTINGS
@given(text=hostile_text)
@example(text="a\u200d\u0000\u200db")
def test_cleaning_removes_only_what_the_rule_names_and_is_idempotent(text: str) -> None:
    cleaned = clean_text(text)
    assert clean_text(cleaned) == cleaned
    # Every letter, mark, number, punctuation, symbol and space survives, in order; a
    # whitespace control becomes a space.
    spaced = "".join(" " if unicodedata.category(c) == "Cc" and c.isspace() and c not in "\n\t"
                     else c for c in text)
    assert [c for c in cleaned if kept_as_is(c)] == [c for c in spaced if kept_as_is(c)]
    for index, char in enumerate(cleaned):
        category = unicodedata.category(char)
        assert category not in ("Cs", "Co", "Cn"), repr(char)
        assert category != "Cc" or char in "\n\t\0 ", repr(char)
        if category == "Cf":
            assert char in JOINERS and 0 < index < len(cleaned) - 1, repr(cleaned)
    assert SpeechRequest(request_id="r", text=text).text == cleaned


@RULE_SETTINGS
@given(text=hostile_text)
@example(text=ONCE_FAILED[0])
def test_text_is_refused_exactly_when_it_holds_a_nul_or_nothing_to_speak(text: str) -> None:
    result = outcome(text)
    if "\0" in text:
        assert result == "invalid_text"
    elif not any(speakable_category(char) for char in text):
        assert result == "nothing_to_speak"
    else:
        assert result == "speaks"
        assert any(speakable_category(char) for char in check_text(text))


def test_the_input_limit_is_configurable_up_to_the_engines_maximum_and_no_further() -> None:
    from pydantic import ValidationError

    from serve_app.config import ApiConfig
    from serve_app.front.schemas import NativeSpeechBody, OpenAISpeechBody

    assert ApiConfig().max_input_chars == ApiConfig(max_input_chars=MAX_TEXT_CHARS).max_input_chars
    with pytest.raises(ValidationError, match=f"above the {MAX_TEXT_CHARS} characters"):
        ApiConfig(max_input_chars=MAX_TEXT_CHARS + 1)
    # The bodies do not cap the text: the ingress holds it to the configured limit.
    long_text = "x" * (MAX_TEXT_CHARS + 1)
    assert NativeSpeechBody(text=long_text).text == long_text
    assert OpenAISpeechBody(model="tts-1", voice="alloy", input=long_text).input == long_text
    assert outcome("x" * 10) == "speaks"
    with pytest.raises(InvalidRequestError) as refused:
        check_text("x" * 11, max_chars=10, param="input")
    assert (refused.value.code, refused.value.param) == ("text_too_long", "input")
