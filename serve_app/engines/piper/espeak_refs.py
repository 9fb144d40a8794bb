"""Plugs a memory leak in piper-tts's espeak-ng bridge (``piper.espeakbridge.get_phonemes``).

In piper-tts 1.8.0 the C function builds each ``(phonemes, terminator, end_of_sentence)`` clause
tuple with ``Py_BuildValue`` and hands it to ``PyList_Append``, which takes a reference of its own;
the reference ``Py_BuildValue`` returned is never released. Every clause of every request the
engine phonemizes therefore stays in memory for good: measured, 10,000 calls on a four-clause
text kept 6.5 MB (about 160 bytes a clause), without end.

:func:`release_leaked_clause_refs` replaces the module's function with one that gives back that
one extra reference per clause tuple. It measures first: only when a clause tuple holds exactly
one reference more than a tuple built here in the same way does it wrap; a bridge that does not
leak (a fixed release) is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

_PROBE_TEXT = "One, two. Three!"
_MARK = "_serve_app_releases_leaked_refs"
_lock = threading.Lock()

_py_decref = ctypes.pythonapi.Py_DecRef
_py_decref.argtypes = [ctypes.py_object]
_py_decref.restype = None


def extra_clause_refs(get_phonemes: Callable[[str], list[Any]]) -> int:
    """References a fresh clause tuple holds beyond its list's (0 when the bridge is sound).

    Compared with a tuple made here and held the same way (in a list, read by index), so the
    interpreter's own counting details cancel out.
    """
    clauses = get_phonemes(_PROBE_TEXT)
    made_here = [tuple([str(index), "", False]) for index in range(len(clauses))]
    extra = sys.getrefcount(clauses[0]) - sys.getrefcount(made_here[0])
    if extra == 1:
        for clause in clauses:  # the probe's own clauses, too
            _py_decref(clause)
    return extra


def release_leaked_clause_refs(voice: Any) -> bool:
    """Wrap ``piper.espeakbridge.get_phonemes`` if it leaks; True when the wrapper is in place.

    ``voice`` (a ``PiperVoice``) phonemizes once first, which loads espeak-ng and its voice.
    """
    from piper import espeakbridge
    from piper.config import PhonemeType

    if voice.config.phoneme_type != PhonemeType.ESPEAK:
        return False  # this voice never calls the bridge
    with _lock:
        if getattr(espeakbridge.get_phonemes, _MARK, False):
            return True
        voice.phonemize(_PROBE_TEXT)
        leaking = espeakbridge.get_phonemes
        extra = extra_clause_refs(leaking)
        if extra != 1:
            if extra:
                logger.warning("espeak bridge: clause tuples hold %d unexpected references; "
                               "left as is", extra)
            return False

        def get_phonemes(text: str) -> list[tuple[str, str, bool]]:
            clauses = leaking(text)
            for clause in clauses:
                _py_decref(clause)  # the list keeps its own reference
            return clauses

        setattr(get_phonemes, _MARK, True)
        espeakbridge.get_phonemes = get_phonemes
        logger.info("espeak bridge: releasing the reference it leaks per clause")
        return True
