"""The scheduler's token budget per step (:class:`PrefillBudget`): prompts are taken while they
fit one padded prefill pass and the row limit; the first always fits."""

from __future__ import annotations

from serve_app.engines.minicpmo.scheduler import PrefillBudget


def test_prompts_are_taken_while_rows_times_the_longest_fit_the_tokens() -> None:
    budget = PrefillBudget(max_prompts=8, max_tokens=21)
    assert budget.take([1] * 5) and budget.take([1] * 7)
    assert budget.take([1] * 3)  # 3 rows x 7 = 21
    assert not budget.take([1] * 2)  # 4 x 7 = 28
    assert [len(p) for p in budget.prompts] == [5, 7, 3] and budget.longest == 7


def test_the_first_prompt_always_fits_and_rows_are_capped() -> None:
    long = PrefillBudget(max_prompts=8, max_tokens=8)
    assert long.take([1] * 300) and not long.take([1])
    rows = PrefillBudget(max_prompts=2, max_tokens=1000)
    assert rows.take([1]) and rows.take([1]) and not rows.take([1])
