"""The chat LLM step's rows (``llm_step_rows``): a step whose rows are only the chat streams
that take a token, gathered by slot (padding rows pointing at the first stream's slot), gives
the same tokens and writes the same keys and values (to float rounding) as the step over every
LLM slot below the highest, as :class:`LLMStepGraphs` lays their inputs out (``_place``) for its
CUDA graphs. On the CPU the graphs' forward runs eagerly on those inputs, with
``visible_ranges`` attention (the layer's own path over the ranges' mask; the CUDA kernel that
reads rows by slot is checked against the layer in test_range_attention.py)."""

from __future__ import annotations

import torch

from serve_app.engines.minicpmo.device.llm_step import LLMStepGraphs, LLMStepInputs
from serve_app.engines.minicpmo.model.layers import SlotKVCache, set_one_query_attention
from serve_app.engines.minicpmo.model.loader import load_speech_model

SLOTS = 8
POSITIONS = 128
WINDOW = 4  # ids the repetition penalty looks at


def random_cache(cfg) -> SlotKVCache:
    cache = SlotKVCache(cfg, SLOTS, POSITIONS, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(3)
    for store in (cache.all_keys, cache.all_values):
        store.copy_(torch.randn(store.shape, generator=generator))
    return cache


def step_inputs(count: int) -> LLMStepInputs:
    """Streams at different positions; one greedy, the others sampled (top-k within the
    candidates' reach, one with a repetition penalty), each with its own seed and counter."""
    generator = torch.Generator().manual_seed(5)
    return LLMStepInputs(
        token=torch.randint(0, 100, (count,), generator=generator),
        position=torch.tensor([5, 60, 17, 99][:count]),
        active=torch.ones(count, dtype=torch.bool),
        temperature=torch.tensor([1.0, 0.7, 0.7, 1.2][:count]),
        top_p=torch.tensor([1.0, 0.8, 0.9, 1.0][:count]),
        top_k=torch.tensor([1, 20, 20, 5][:count]),
        penalty=torch.tensor([1.0, 1.05, 1.0, 1.0][:count]),
        greedy=torch.tensor([True, False, False, False][:count]),
        seed=torch.tensor([11, 12, 13, 14][:count]),
        counter=torch.tensor([0, 3, 9, 27][:count]),
        window=torch.randint(0, 100, (count, WINDOW), generator=generator))


def step(graphs: LLMStepGraphs, slots: list[int], x: LLMStepInputs) -> torch.Tensor:
    """What the graph that ``_place`` picks would replay, run eagerly: the rows' tokens."""
    shape, index, path = graphs._place(slots, x, None)
    return graphs._forward(graphs.keys.index((*shape, path)))[index]


@torch.inference_mode()
def test_a_step_of_the_streams_rows_gives_what_the_slot_range_gives(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    llm = model.llm
    set_one_query_attention(llm, "visible_ranges")
    cfg = model.config.llm
    slots = [6, 1, 4]  # spread over the slots, out of order, as slots freed and taken again
    x = step_inputs(len(slots))

    by_range_cache, by_rows_cache = random_cache(cfg), random_cache(cfg)
    by_range = LLMStepGraphs(llm, by_range_cache, WINDOW, torch.device("cpu"),
                             whole_span_only=True)
    by_rows = LLMStepGraphs(llm, by_rows_cache, WINDOW, torch.device("cpu"),
                            whole_span_only=True, gathered=True)
    assert by_range.shape(slots, x)[0] == 8  # every slot below the highest: 5 of them padding
    assert by_rows.shape(slots, x)[0] == 4  # the streams' rows and one padding row
    before = by_range_cache.all_keys.clone()

    # twice: the second step's layout over the first's leftovers (fewer streams, other slots)
    for streams in (slots, [3, 6]):
        inputs = x if streams == slots else step_inputs(2)
        want = step(by_range, streams, inputs)
        got = step(by_rows, streams, inputs)
        assert torch.equal(got, want)
        if streams == slots:
            assert by_rows.rows[:4].tolist() == [6, 1, 4, 6]  # the padding row: slot 6's
    assert by_rows.rows[:2].tolist() == [3, 6]

    # the same keys and values where a stream wrote (padding rows write scratch positions only),
    # and nowhere else
    scratch = by_range_cache.scratch_position
    for a, b in ((by_range_cache.all_keys, by_rows_cache.all_keys),
                 (by_range_cache.all_values, by_rows_cache.all_values)):
        # up to float rounding: a batch of another size blocks the matmuls otherwise
        torch.testing.assert_close(a[..., :scratch, :], b[..., :scratch, :], rtol=1e-5,
                                   atol=1e-5)
    written = (by_range_cache.all_keys != before).any(dim=(0, 2, 4))[:, :scratch]
    assert written.nonzero().tolist() == [[1, 60], [3, 5], [4, 17], [6, 5], [6, 60]]
