"""Admission by work (serve_app/engines/work_admission.py): the step model learns what each kind
of stream costs from the steps it sees, the gate admits only what the budget holds, and a
waiting stream is refused once its first audio could no longer come in time."""

from __future__ import annotations

import pickle
import random
import time

import numpy as np
import pytest

from serve_app.engines.errors import EngineOverloadedError
from serve_app.engines.work_admission import StepLoadModel, StreamWork, WorkAdmission

READ, CHAT = StreamWork(), StreamWork(chat=True)
CLONED_CHAT = StreamWork(chat=True, cloned=True)


def true_load(counts: np.ndarray) -> float:
    """A made-up engine: 0.06 of the budget with no stream, read 0.0004, chat 0.0018 each,
    a cloned voice 0.0001 more, streamed text nothing more."""
    return 0.06 + float(np.array([0.0004, 0.0018, 0.0001, 0.0]) @ counts)


def steps(count: int, seed: int = 0) -> list[tuple[np.ndarray, float]]:
    """Steps of a service whose mix of read and chat streams drifts, with noisy step times."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        read, chat = rng.randint(0, 800), rng.randint(0, 200)
        cloned = rng.randint(0, chat)
        counts = np.array([read, chat, cloned, 0.0])
        out.append((counts, true_load(counts) * rng.uniform(0.95, 1.05)))
    return out


def test_the_model_learns_each_kinds_cost_from_the_steps_it_sees():
    # Its prior (slot admission's: 1024 read or 256 chat slots at a 0.5 limit) is wrong by 20 %
    # for read and by 10 % for chat; after the steps the costs are the engine's own.
    model = StepLoadModel([0.5 / 1024, 0.5 / 256, 0.0, 0.0], 0.05)
    for counts, load in steps(400):
        model.observe(counts, load)
    read, chat = model.costs[:2]
    assert read == pytest.approx(0.0004, rel=0.05)
    assert chat == pytest.approx(0.0018, rel=0.05)
    assert model.load(np.array([768, 256, 0, 0])) == pytest.approx(
        true_load(np.array([768, 256, 0, 0])), rel=0.05)


def test_one_slow_step_after_a_steady_load_never_makes_the_gate_admit_more():
    # Thousands of identical steps pin the load where the service runs; one slow step then (a
    # GC pause, say) counts at most half a budget off: the projections near the service's
    # point rise by less than that, and never fall (the gate errs towards refusing).
    model = StepLoadModel([0.5 / 1024, 0.5 / 256, 0.0, 0.0], 0.05)
    for counts, load in steps(300):
        model.observe(counts, load)
    steady = np.array([512.0, 64.0, 0.0, 0.0])
    for _ in range(5000):
        model.observe(steady, true_load(steady))
    near = [steady + np.array([0.0, 16.0, 0.0, 0.0]), steady + np.array([64.0, 0.0, 0.0, 0.0])]
    before = [model.load(counts) for counts in near]
    assert before == pytest.approx([true_load(counts) for counts in near], rel=0.05)
    model.observe(np.array([10.0, 0.0, 0.0, 0.0]), 2.0)  # a 200 ms pause in a 107 ms budget
    for counts, was in zip(near, before):
        assert was <= model.load(counts) < was + 0.5


def test_an_engine_slower_than_its_prior_is_learned_within_a_few_dozen_steps():
    # A cold engine's prior says its 16 slots fill the limit; the machine is five times
    # slower. After the steps of a few streams the gate admits what the machine can carry.
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=16, max_chat_slots=4)
    per_read = 5 * 0.45 / 16
    for step in range(40):
        open_reads = 1 + step % 4
        admission.observe_step(np.array([open_reads, 0.0, 0.0, 0.0]),
                               0.05 + per_read * open_reads, 0.1)
    admitted = 0
    with pytest.raises(EngineOverloadedError):
        while True:
            admission.take([READ])
            admitted += 1
    assert admitted == int((0.5 - 0.05) / per_read)  # 3, where the prior said 16


def test_a_cold_engine_admits_as_many_streams_as_its_slots():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=16, max_chat_slots=4)
    for _ in range(16):
        admission.take([READ])
    with pytest.raises(EngineOverloadedError) as refused:
        admission.take([READ])
    assert refused.value.reason == "work"
    assert admission.snapshot()["refused_work"] == 1


def test_a_measured_engine_admits_by_what_the_streams_cost():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=1024, max_chat_slots=256)
    for counts, load in steps(400):
        admission.observe_step(counts, load, 0.05)
    # 0.06 + 600 x 0.0004 = 0.30: 0.20 of the limit is left, 111 chat streams' worth
    admission.take([READ] * 600)
    admitted_chat = 0
    with pytest.raises(EngineOverloadedError):
        while True:
            admission.take([CHAT])
            admitted_chat += 1
    assert 100 <= admitted_chat <= 122
    # the refused stream changed nothing; a read stream (cheaper) may still fit
    load = admission.snapshot()["work_load"]
    assert load <= 0.5
    # streams ending give their work back
    for _ in range(600):
        admission.release(READ)
    admission.take([CHAT] * 100)


def test_an_engine_that_learned_a_slow_spell_still_takes_a_stream_when_it_holds_none():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=8, max_chat_slots=2)
    for _ in range(200):  # a machine so busy that one stream took twice the budget
        admission.observe_step(np.array([1.0, 0.0, 0.0, 0.0]), 2.0, 0.05)
    admission.take([READ])  # idle: taken, and its steps will say how fast the engine is now
    with pytest.raises(EngineOverloadedError):
        admission.take([READ])
    admission.release(READ)
    admission.take([READ])


def test_a_batch_is_taken_whole_or_not_at_all():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=8, max_chat_slots=8)
    admission.take([READ] * 6)
    with pytest.raises(EngineOverloadedError):
        admission.take([READ] * 3)
    admission.take([READ] * 2)  # the failed batch left nothing behind


def test_slot_admission_only_counts():
    admission = WorkAdmission("slots", 0.5, 0.5, max_slots=4, max_chat_slots=4)
    admission.take([CHAT] * 100)
    assert admission.snapshot()["admitted_streams"] == 100
    assert admission.snapshot()["work_limit"] == 0.0
    assert admission.expired([(10.0, False), (100.0, True)]) == [False, False]


def test_a_waiting_stream_is_refused_once_its_first_audio_cannot_come_in_time():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16)
    admission.observe_first_audio(0.2)  # a read stream's first audio: 0.2 s after admission
    admission.observe_first_audio(0.4, chat=True)
    admission.observe_step(np.zeros(4), 0.0, 0.05)  # 50 ms steps
    assert admission.expired([(0.1, False), (0.29, False), (0.31, False), (2.0, False)]) == [
        False, False, True, True]
    # a chat stream's first audio takes longer: it may wait less, but never under one step
    assert admission.expired([(0.09, True), (0.11, True)]) == [False, True]
    admission.observe_first_audio(0.9, chat=True)
    assert admission.expired([(0.04, True), (0.06, True)]) == [False, True]
    # an admission that passed streams over refuses those the next one would start too late
    assert admission.expired([(0.2, False), (0.26, False)], next_step=True) == [False, True]
    assert admission.shortest_wait_s(next_step=True) == pytest.approx(0.0)
    admission.take([CLONED_CHAT])
    error = admission.refuse_waiting(CLONED_CHAT)
    assert error.reason == "wait"
    assert admission.snapshot()["refused_wait"] == 1
    assert admission.snapshot()["work_load"] == pytest.approx(admission.model.intercept)


def test_the_wait_leaves_room_for_the_tail_of_first_audio_not_its_mean():
    """Eight streams' first audio 0.1 s after admission and two's 0.4 s: a queued read stream's
    allowance (0.5 s deadline) is what the slow fifth leaves (the mean would leave 0.34 s), so
    the admitted streams' TTFB tail stays inside the deadline."""
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16)
    admission.observe_step(np.zeros(4), 0.0, 0.02)  # 20 ms steps
    for after_s in [0.1] * 8 + [0.4] * 2:
        admission.observe_first_audio(after_s)
    assert admission.expired([(0.09, False), (0.15, False)]) == [False, True]


def test_a_queued_stream_waits_no_longer_than_max_queue_wait_but_always_a_step():
    """A deadline that leaves 0.3 s of waiting (0.2 s first audio, 0.5 s deadline) is cut to
    max_queue_wait_s, so a refusal from the queue comes within it; a step longer than the cap
    is still waited for (every queued stream gets the next admission)."""
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16,
                              max_queue_wait_s=0.1)
    admission.observe_first_audio(0.2)
    admission.observe_step(np.zeros(4), 0.0, 0.05)  # 50 ms steps
    assert admission.expired([(0.09, False), (0.11, False), (0.29, False)]) == [False, True, True]
    assert admission.expired([(0.04, False), (0.06, False)], next_step=True) == [False, True]
    for _ in range(60):  # steps of 150 ms: the cap is below one step, a step is the floor
        admission.observe_step(np.zeros(4), 0.0, 0.15)
    assert admission.expired([(0.14, False), (0.16, False)]) == [False, True]
    uncapped = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16)
    uncapped.observe_first_audio(0.2)
    uncapped.observe_step(np.zeros(4), 0.0, 0.05)
    assert uncapped.expired([(0.11, False), (0.29, False)]) == [False, False]


def test_a_queue_that_would_start_a_stream_too_late_refuses_it_at_once():
    admission = WorkAdmission("work", 0.0, 0.5, max_slots=1024, max_chat_slots=256)
    admission.observe_first_audio(0.2)
    admission.observe_step(np.zeros(4), 0.0, 0.05)  # 50 ms steps
    # 16 admitted a step: 64 ahead start within 4-5 steps (0.25 s), over the 0.3 s allowance?
    admission.take([READ], queued_ahead=64, admissions_per_step=16)  # 5 steps: 0.25 s
    with pytest.raises(EngineOverloadedError) as refused:
        admission.take([READ], queued_ahead=160, admissions_per_step=16)  # 11 steps: 0.55 s
    assert refused.value.reason == "queue"


def test_a_stream_running_dry_holds_admission_until_the_engine_catches_up():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16,
                              behind_hold_s=0.3)
    counts = np.array([4.0, 0.0, 0.0, 0.0])
    admission.observe_step(counts, 0.1, 0.05)  # on time: admission stays open
    admission.take([READ])
    admission.observe_step(counts, 0.1, 0.05, ran_dry=1)
    assert admission.holding()
    with pytest.raises(EngineOverloadedError) as refused:
        admission.take([READ])
    assert refused.value.reason == "behind"
    assert admission.snapshot()["refused_behind"] == 1
    # a queued stream waits for no hold it cannot outlast: refused at the next step, as soon
    # as the hold begins, not once its allowance has run out (0.3 s of hold > two 50 ms steps)
    admission.observe_first_audio(0.45)
    assert admission.expired([(0.0, False)]) == [True]
    assert admission.shortest_wait_s() < 0
    time.sleep(0.4)  # the hold is over with no dry step since
    assert admission.expired([(0.0, False)]) == [False]
    assert not admission.holding()
    admission.take([READ])


def test_a_step_that_left_thin_listeners_uncut_pauses_the_queue_for_one_step():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16)
    counts = np.array([40.0, 0.0, 0.0, 0.0])
    admission.observe_step(counts, 0.3, 0.05, uncut_thin=5)
    assert admission.holding()  # queued streams wait ...
    admission.take([READ])  # ... but a new one is still taken (no stream ran dry)
    # unless the step it waits for would leave it too little time: refused at once
    admission.observe_first_audio(0.44)  # 0.06 s left of the deadline: one step
    with pytest.raises(EngineOverloadedError) as refused:
        admission.take([READ], queued_ahead=0, admissions_per_step=16)
    assert refused.value.reason == "queue"
    admission.observe_step(counts, 0.3, 0.05)
    assert not admission.holding()
    admission.take([READ], queued_ahead=0, admissions_per_step=16)


def test_a_queued_stream_the_thin_hold_would_start_too_late_is_refused_before_the_held_step():
    """At a step's start (no admission yet), with 0.06 s of allowance (0.44 s first audio,
    0.5 s deadline) and 50 ms steps: a stream that has waited 0.02 s could still start at this
    step's admission, so it waits; once a step leaves thin listeners uncut, this step's
    admission starts none, and the next comes too late for it: refused now, not when the held
    admission passes it over."""
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16)
    counts = np.array([40.0, 0.0, 0.0, 0.0])
    admission.observe_first_audio(0.44)
    admission.observe_step(counts, 0.3, 0.05)
    assert admission.expired([(0.0, False), (0.02, False)]) == [False, False]
    assert admission.shortest_wait_s() > 0.02
    admission.observe_step(counts, 0.3, 0.05, uncut_thin=5)
    assert admission.expired([(0.0, False), (0.02, False)]) == [False, True]
    assert admission.shortest_wait_s() < 0.02
    # the admission after the held one: as before (a step ahead only once it passed them over)
    admission.observe_step(counts, 0.3, 0.05)
    assert admission.expired([(0.02, False)]) == [False]
    assert admission.expired([(0.02, False)], next_step=True) == [True]


def test_without_the_thin_hold_thin_listeners_neither_pause_the_queue_nor_delay_a_new_stream():
    admission = WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16,
                              thin_holds_queue=False)
    counts = np.array([40.0, 0.0, 0.0, 0.0])
    admission.observe_step(counts, 0.3, 0.05, uncut_thin=5)
    assert not admission.holding()  # the queue starts at the next step
    # a new stream's wait is projected without the held step: with one step left of its
    # deadline it is still taken (the thin hold refuses it: the test above)
    admission.observe_first_audio(0.44)
    admission.take([READ], queued_ahead=0, admissions_per_step=16)
    assert admission.snapshot()["refused_queue"] == 0


def test_without_a_hold_or_admitting_by_slots_a_dry_stream_changes_nothing():
    for admission in (WorkAdmission("work", 0.5, 0.5, max_slots=64, max_chat_slots=16),
                      WorkAdmission("slots", 0.5, 0.5, max_slots=64, max_chat_slots=16,
                                    behind_hold_s=5.0)):
        admission.observe_step(np.array([4.0, 0.0, 0.0, 0.0]), 0.1, 0.05, ran_dry=3,
                               uncut_thin=0 if admission.by_work else 3)
        assert not admission.holding()
        admission.take([READ])


def test_the_reason_survives_the_hop_between_processes():
    error = pickle.loads(pickle.dumps(EngineOverloadedError("budget full", "work")))
    assert (error.reason, error.message) == ("work", "budget full")


def test_the_queue_projects_a_new_streams_wait_at_the_pace_it_has_been_starting_streams():
    """A queue held by pauses or a prefill budget starts fewer streams a step than the most it
    may: a new stream's wait is projected at the pace measured while streams waited, so one it
    would start too late is refused at submission (quick), not after its wait (slow)."""
    admission = WorkAdmission("work", 0.0, 0.5, max_slots=1024, max_chat_slots=256)
    admission.observe_first_audio(0.2)
    admission.observe_step(np.zeros(4), 0.0, 0.05)  # 50 ms steps: 0.3 s allowance, 6 steps
    admission.take([READ], queued_ahead=64, admissions_per_step=16)  # 5 steps at 16 a step
    # steps that started 2 of the streams waiting, then one that held them all
    for started in (2, 2, 2, 2, 0, 2, 2, 2, 2, 2):
        admission.observe_queue(started, queued=40, most=16)
    with pytest.raises(EngineOverloadedError) as refused:
        admission.take([READ], queued_ahead=64, admissions_per_step=16)
    assert refused.value.reason == "queue"
    admission.take([READ], queued_ahead=2, admissions_per_step=16)  # within two steps: taken
    # a queue that empties says only that it could start the most: the pace recovers
    for _ in range(30):
        admission.observe_queue(5, queued=5, most=16)
    admission.take([READ], queued_ahead=64, admissions_per_step=16)
