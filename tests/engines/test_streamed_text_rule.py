"""The one rule both engines use to cut streamed text into pieces spoken before the input ends
(serve_app/engines/streamed_text.py)."""

from __future__ import annotations

from serve_app.engines.streamed_text import MAX_CLAUSE_CHARS, clause_ends, complete_clauses


def pieces(text: str, done: bool = False) -> tuple[list[str], str]:
    return complete_clauses(text, done)


def test_sentence_ends_as_before() -> None:
    assert pieces("One. Two; three: four") == (["One.", " Two;", " three:"], " four")
    assert pieces("Pi is 3.14 and") == ([], "Pi is 3.14 and")
    assert pieces("Ends here.") == (["Ends here."], "")
    assert pieces("line\n next") == (["line\n"], " next")
    assert pieces("line\n") == (["line\n"], "")
    assert pieces(" no end", done=True) == ([" no end"], "")
    assert pieces("  ", done=True) == ([], "")


def test_commas_and_other_clause_marks_end_a_piece() -> None:
    assert pieces("Well, you see, I") == (["Well,", " you see,"], " I")
    assert pieces("It costs 1,000 dollars, or") == (["It costs 1,000 dollars,"], " or")
    assert pieces("Wait\u2026 what \u2014 now") == (["Wait\u2026", " what \u2014"], " now")
    assert pieces('He said "stop," then') == (['He said "stop,"'], " then")
    assert pieces("(yes, really) and") == (["(yes,"], " really) and")
    assert pieces("first line\nsecond") == (["first line\n"], "second")
    # the end of the text so far counts as a break: a pause after a comma speaks the clause
    assert pieces("Sure,") == (["Sure,"], "")


def test_full_width_marks_need_no_space_after_them() -> None:
    assert pieces("\u4f60\u597d\uff0c\u4e16\u754c\u3002\u518d\u89c1") == (
        ["\u4f60\u597d\uff0c", "\u4e16\u754c\u3002"], "\u518d\u89c1")
    assert pieces("\u4e00\u3001\u4e8c\u3001\u4e09") == (["\u4e00\u3001", "\u4e8c\u3001"], "\u4e09")


def test_a_long_run_without_a_break_is_cut_at_its_last_space_within_the_cap() -> None:
    words = " ".join(f"word{n:02d}" for n in range(40))  # 279 characters, no break
    got, rest = pieces(words)
    assert all(len(piece) <= MAX_CLAUSE_CHARS for piece in got)
    assert len(got) == 2 and "".join(got) + rest == words
    assert got[0] == words[:words.rindex(" ", 0, MAX_CLAUSE_CHARS + 1)]
    assert all(piece.strip().split(" ")[-1].startswith("word") for piece in got)  # whole words
    assert len(rest) <= MAX_CLAUSE_CHARS
    # not cut before there are more than the cap's characters
    assert pieces(words[:MAX_CLAUSE_CHARS]) == ([], words[:MAX_CLAUSE_CHARS])


def test_a_break_within_the_cap_comes_first_and_the_cap_counts_from_it() -> None:
    text = "Yes, " + "a" * 10 + " " + "b" * 120
    assert clause_ends(text)[0] == 4
    # at the last space within 100 characters of "Yes,": the space starts the next piece
    assert clause_ends(text)[1] == len("Yes, " + "a" * 10)


def test_a_word_longer_than_the_cap_is_cut_at_the_cap() -> None:
    text = "x" * (MAX_CLAUSE_CHARS * 2 + 5)
    assert clause_ends(text) == [MAX_CLAUSE_CHARS, 2 * MAX_CLAUSE_CHARS]
