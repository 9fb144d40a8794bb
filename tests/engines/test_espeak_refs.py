"""Phonemizing keeps nothing: the espeak bridge's leaked clause references are given back."""

from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest
from piper import espeakbridge

from serve_app.engines.piper import espeak_refs
from serve_app.engines.piper.piper_engine import PiperEngine
from tests.own_process import call_in_own_process

TEXT = "Hello there, friend. This is a second sentence; and a third one!"


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = PiperEngine.from_options(intra_op_threads=1)
    yield engine
    engine.close()


def _kept_bytes(call, times: int) -> int:
    call()  # first-use allocations are not a leak
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(times):
            call()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def kept_bytes_of_phonemizing() -> int:
    """Bytes 2,000 phonemizer calls keep (run by the test below in a process of its own)."""
    engine = PiperEngine.from_options(intra_op_threads=1)
    try:
        return _kept_bytes(lambda: engine._phonemizer.phonemize(TEXT), 2000)
    finally:
        engine.close()


def test_phonemizing_many_texts_keeps_no_memory() -> None:
    # Unfixed, 2,000 calls on this text keep about 1.3 MB (160 bytes per clause). tracemalloc
    # runs in a process of its own (tests/own_process.py says why).
    kept = call_in_own_process("tests.engines.test_espeak_refs", "kept_bytes_of_phonemizing")
    assert kept < 20_000


def test_clause_tuples_hold_only_their_lists_reference(engine: PiperEngine) -> None:
    assert getattr(espeakbridge.get_phonemes, espeak_refs._MARK, False)
    assert espeak_refs.extra_clause_refs(espeakbridge.get_phonemes) == 0
    clauses = espeakbridge.get_phonemes(TEXT)
    assert [clause[1:] for clause in clauses] == [(",", False), (".", True), (";", False),
                                                  ("!", True)]
    first = clauses[0]
    del clauses
    # The list was the only other owner: the tuple is now ours alone (+1 for the call's argument).
    assert sys.getrefcount(first) == 2


def test_wrapping_twice_is_a_no_op(engine: PiperEngine) -> None:
    wrapped = espeakbridge.get_phonemes
    assert espeak_refs.release_leaked_clause_refs(engine._voice)
    assert espeakbridge.get_phonemes is wrapped
