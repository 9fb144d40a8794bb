"""Hostile and odd text for the property tests (hypothesis strategies), and the strings that
once broke the service, kept so they are tried first on every run."""

from __future__ import annotations

from hypothesis import strategies as st

# The report that opened issue 16 (scripts/serve, Piper): 500s and empty 200s, plus texts that
# gave empty streams in the engines while the rule was written.
ONCE_FAILED = [
    "\u0000\u0001\u0002",          # 500: a NUL ended espeak-ng's C string
    "Hello\u0000world",            # 500
    "\u200b\u200b\u200b",          # 200 with a 44-byte WAV: nothing to speak
    " \t\u0007 ",                  # 200 with a 44-byte WAV
    "\U000c4a7e",                  # unassigned: a 44-byte WAV
    "...",                         # espeak-ng says nothing for it: a 44-byte WAV
    "a\ud800b",                    # a lone surrogate cannot even be encoded to UTF-8
]
# What must still speak: the table's last rows.
SPEAKS = ["!?", "\U0001F600\U0001F600", "x" * 4000, "<speak>Hello <break/> world</speak>",
          "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
          "\u4f60\u597d\uff0c\u4e16\u754c"]

# Words of many scripts, emoji sequences with joiners and variation selectors, numbers, markup.
SCRIPT_SAMPLES = [
    "Hello", "h\u00e9llo", "\u041f\u0440\u0438\u0432\u0435\u0442", "\u0645\u0631\u062d\u0628\u0627",
    "\u05e9\u05dc\u05d5\u05dd", "\u4e2d\u6587", "\u65e5\u672c\u8a9e", "\ud55c\uad6d\uc5b4",
    "\u0939\u093f\u0928\u094d\u0926\u0940", "\u0e44\u0e17\u0e22", "\u0395\u03bb\u03bb\u03b7\u03bd",
    "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\U0001F600", "\u2764\ufe0f",
    "\U0001F468\u200d\U0001F469\u200d\U0001F467", "42", "\u00bd", "$5", "?!", "...", "\u2014",
    "<b>", "&amp;", " ", "\n", "\t",
]
# Control, format, surrogate, private-use, unassigned, separator and lone combining characters.
ODD_CHARACTERS = st.characters(categories=["Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp", "Mn",
                                           "Me"])
ANY_CHARACTER = st.characters(exclude_categories=())  # every category, surrogates included

any_text = st.text(ANY_CHARACTER, max_size=40)
odd_text = st.text(ODD_CHARACTERS, max_size=20)
mixed_scripts = st.lists(st.one_of(st.sampled_from(SCRIPT_SAMPLES), odd_text),
                         max_size=8).map("".join)
long_runs = st.builds(lambda prefix, char, count: prefix + char * count,
                      st.sampled_from(["", "Hi ", "\u4e2d "]), st.one_of(ANY_CHARACTER,
                                                                         ODD_CHARACTERS),
                      st.integers(1, 150))
hostile_text = st.one_of(st.sampled_from(ONCE_FAILED), any_text, mixed_scripts, long_runs)
