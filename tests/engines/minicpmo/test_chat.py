"""Chat mode: the engine's answer is the LLM's own greedy continuation of the prompt, alone and
when admitted together with other streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.layers import SlotKVCache, set_one_query_attention
from serve_app.engines.minicpmo.device.llm_step import (
    LLMStepGraphs,
    LLMStepInputs,
    llm_decode_step,
    llm_key_spans,
    llm_prefill,
)
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.text import PIECE_TOKENS, TTS_EOS_MARK, PieceDecoder

ANSWER_TOKENS = 9


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4,
                            max_chat_slots=3, tts_max_positions=1024, llm_max_positions=256)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


def chat_request(request_id: str, text: str) -> SpeechRequest:
    return SpeechRequest(request_id=request_id, text=text, mode="chat",
                         sampling=SamplingParams(temperature=0.0, repetition_penalty=1.0),
                         lengths=LengthControls(llm_tokens=ANSWER_TOKENS, audio_frames=30))


def reference_answer(engine: MiniCPMOEngine, request: SpeechRequest) -> str:
    """Greedy decoding by recomputing the whole sequence for every token (no cache reuse)."""
    tok = engine.model.tokenizer
    ids = tok(engine.plan(request).prompt, add_special_tokens=False)["input_ids"] + engine._gen_prompt_ids
    answer: list[int] = []
    with torch.inference_mode():
        for _ in range(ANSWER_TOKENS):
            sequence = torch.tensor([ids + answer])
            cache = SlotKVCache(engine.model.config.llm, 1, sequence.shape[1], torch.device("cpu"),
                                torch.float32)
            hidden = llm_prefill(engine.model.llm, cache, sequence, torch.ones_like(sequence, dtype=torch.bool),
                                 torch.tensor([0]), True)
            answer.append(int(engine.model.llm.logits(hidden[:, -1]).argmax()))
    decoder = PieceDecoder(tok.decode, engine._terminators)
    pieces = [decoder.push(answer[i:i + PIECE_TOKENS]) for i in range(0, len(answer), PIECE_TOKENS)]
    return "".join(piece.split(TTS_EOS_MARK)[0] for piece in pieces)


async def spoken_text(stream) -> str:
    return "".join([chunk.text async for chunk in stream])


def test_chat_answer_is_the_greedy_continuation_alone_and_batched(engine):
    questions = {"chat-a": "Tell me about rivers.", "chat-b": "What is the tallest mountain?"}
    want = {rid: reference_answer(engine, chat_request(rid, text)) for rid, text in questions.items()}
    assert len(set(want.values())) == 2  # the two answers differ, so a mix-up would show

    async def alone() -> str:
        (stream,) = engine.submit([chat_request("alone-a", questions["chat-a"])])
        return await spoken_text(stream)

    async def together() -> list[str]:
        # admitted in one batch with a read stream: the chat prompts share one prefill pass
        read = SpeechRequest(request_id="read-x", text="Rivers run to the sea.", mode="read")
        streams = engine.submit([read] + [chat_request(rid, text) for rid, text in questions.items()])
        texts = await asyncio.gather(*(spoken_text(s) for s in streams))
        return texts[1:]

    assert asyncio.run(alone()) == want["chat-a"]
    assert asyncio.run(together()) == [want["chat-a"], want["chat-b"]]


def test_overlapped_llm_step_speaks_the_same_answers(tiny_checkpoint):
    """``overlap_llm_step``: the LLM step launched before the audio window and its tokens taken
    after it gives every chat stream the answer the in-line step gives (greedy, long enough
    answers that the LLM runs ahead of the speech, which is when the step is launched). The
    second stream arrives while the first speaks: its first text comes from several LLM steps
    launched one after another beside the audio window, in one engine step. With
    ``prefill_beside_window`` too, that stream's prefill runs while the window runs and its
    first token is taken at the next step's start; with ``first_text_beside_window`` as well, in
    the same step, before the LLM steps for its first text: the same answers."""
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    requests = [SpeechRequest(request_id=f"long-{i}", text=text, mode="chat",
                              sampling=SamplingParams(temperature=0.0, repetition_penalty=1.0),
                              lengths=LengthControls(llm_tokens=36, audio_frames=60))
                for i, text in enumerate(["Tell me about rivers.", "What is the tallest mountain?"])]

    def answers(overlap: bool, beside: bool = False,
                first_text: bool = False) -> tuple[list[str], int, int, tuple[int, int]]:
        options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                                admission="slots", max_slots=4, max_chat_slots=3, tts_max_positions=1024,
                                llm_max_positions=256, overlap_llm_step=overlap,
                                prefill_beside_window=beside,
                                first_text_beside_window=first_text)
        engine = MiniCPMOEngine(model, options)
        try:
            async def run() -> list[str]:
                first = engine.submit(requests[:1])[0]
                chunks = aiter(first)
                head = await anext(chunks)  # the first stream speaks: the second arrives now
                second = engine.submit(requests[1:])[0]
                rest = [chunk async for chunk in chunks]
                return ["".join(c.text for c in [head, *rest]), await spoken_text(second)]

            spoken = asyncio.run(run())
            most = max((dict(r.work).get("llm_launches", 0) for r in engine.step_log()), default=0)
            work = engine.device_work()
            return (spoken, work.get("llm_launches", 0), most,
                    (work.get("first_tokens_next_step", 0),
                     work.get("first_tokens_beside_window", 0)))
        finally:
            engine.close()

    in_line, no_launches, _, in_line_deferred = answers(False)
    overlapped, launches, most_in_a_step, deferred = answers(True)
    beside, _, _, beside_deferred = answers(True, beside=True)
    same_step, _, most_same_step, same_step_deferred = answers(True, beside=True, first_text=True)
    assert no_launches == 0 and launches > 0
    assert most_in_a_step >= 2 and most_same_step >= 2  # a waiting stream's LLM steps ran
    # beside one window; where the second stream's first token was taken: in its admission
    # (in line), at the next step's start, or in its admission step beside the window
    assert in_line_deferred == deferred == (0, 0)
    assert beside_deferred == (1, 0) and same_step_deferred == (0, 1)
    assert overlapped == in_line and beside == in_line and same_step == in_line and all(in_line)


def random_llm_cache_and_step(engine) -> tuple[SlotKVCache, LLMStepInputs]:
    """An LLM cache of 4 slots (256 positions) of random keys and values, and a greedy step's
    inputs for its rows: three active at positions 3, 40 and 90, one inactive (padding)."""
    generator = torch.Generator().manual_seed(7)
    cache = SlotKVCache(engine.model.config.llm, 4, 256, torch.device("cpu"), torch.float32)
    for store in (cache.all_keys, cache.all_values):
        store.copy_(torch.randn(store.shape, generator=generator))
    rows = 4
    return cache, LLMStepInputs(
        token=torch.randint(0, 100, (rows,), generator=generator),
        position=torch.tensor([3, 40, 0, 90]), active=torch.tensor([True, True, False, True]),
        temperature=torch.ones(rows), top_p=torch.ones(rows), top_k=torch.full((rows,), 1),
        penalty=torch.ones(rows), greedy=torch.ones(rows, dtype=torch.bool),
        seed=torch.zeros(rows, dtype=torch.long), counter=torch.zeros(rows, dtype=torch.long),
        window=torch.zeros(rows, 1, dtype=torch.long))


def test_llm_step_by_visible_ranges_equals_the_sdpa_step(engine):
    """With ``one_query_attention: visible_ranges`` the LLM's decode step attends by ranges (on
    CUDA the one kernel per layer; here the layer's own path over the ranges' mask): each row
    sees its positions so far, a padding row key 0, as the SDPA step's mask has it, so it gives
    the same tokens and writes the same keys and values."""
    llm = engine.model.llm
    cache, x = random_llm_cache_and_step(engine)
    before = cache.all_keys.clone(), cache.all_values.clone()
    with torch.inference_mode():
        by_mask = llm_decode_step(llm, cache, x, torch.arange(4), True, "full")
        written = cache.all_keys.clone(), cache.all_values.clone()
        cache.all_keys.copy_(before[0])
        cache.all_values.copy_(before[1])
        set_one_query_attention(llm, "visible_ranges")
        try:
            by_ranges = llm_decode_step(llm, cache, x, torch.arange(4), True, "full")
        finally:
            set_one_query_attention(llm, "sdpa")
    assert torch.equal(by_ranges, by_mask)
    # every layer's new keys and values (a later layer's come from the attention before it)
    assert len(llm.model.layers) > 1
    changed = (cache.all_keys != before[0]).any(dim=(0, 2, 4))  # [slots, positions]
    assert changed.nonzero().tolist() == [[0, 3], [1, 40], [2, 256], [3, 90]]
    torch.testing.assert_close(cache.all_keys, written[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.all_values, written[1], rtol=1e-5, atol=1e-5)


def test_llm_step_over_a_short_key_span_equals_the_step_over_the_whole_cache(engine):
    """The CUDA graphs of the LLM step read only the shortest key span that holds their rows'
    positions (``llm_key_spans``); that step gives the tokens and logits of the step over
    the whole cache, inactive padding rows (which write to the scratch position past the span)
    included."""
    llm = engine.model.llm
    cache, x = random_llm_cache_and_step(engine)
    rows = len(x.token)
    spans = llm_key_spans(cache.max_positions + 1)
    assert spans == [128, 257]
    with torch.inference_mode():
        whole_cache = cache.all_keys.clone(), cache.all_values.clone()
        full = llm_decode_step(llm, cache, x, torch.arange(rows), True, "full")
        written = cache.all_keys.clone(), cache.all_values.clone()
        cache.all_keys.copy_(whole_cache[0])
        cache.all_values.copy_(whole_cache[1])
        short = llm_decode_step(llm, cache, x, torch.arange(rows), True, "full", spans[0])
    assert torch.equal(short, full)
    # the same keys and values written (deeper layers' to float rounding: their inputs come
    # from attention summed over a shorter span), nothing written past the span but scratch
    torch.testing.assert_close(cache.all_keys, written[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.all_values, written[1], rtol=1e-5, atol=1e-5)
    changed = (cache.all_keys != whole_cache[0]).any(dim=(0, 2, 4))  # [slots, positions]
    assert changed.nonzero().tolist() == [[0, 3], [1, 40], [2, 256], [3, 90]]
    # what the graphs replay: the bucket past the highest slot, the shortest span that holds
    # every position (a position of 128 needs the whole cache here)
    graphs = LLMStepGraphs(llm, cache, 1, torch.device("cpu"))
    assert graphs.shape([0, 1, 2, 3], x) == (4, 128)
    x.position[1] = 128
    assert graphs.shape([0, 1, 2, 3], x) == (4, 257)
