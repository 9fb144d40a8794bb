"""Chat mode: the engine's answer is the LLM's own greedy continuation of the prompt, alone and
when admitted together with other streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.layers import SlotKVCache
from serve_app.engines.minicpmo.llm_step import llm_prefill
from serve_app.engines.minicpmo.loader import load_speech_model
from serve_app.engines.minicpmo.text import PIECE_TOKENS, TTS_EOS_MARK, PieceDecoder

ANSWER_TOKENS = 9


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32", max_slots=4,
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
    answers that the LLM runs ahead of the speech, which is when the step is launched)."""
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    requests = [SpeechRequest(request_id=f"long-{i}", text=text, mode="chat",
                              sampling=SamplingParams(temperature=0.0, repetition_penalty=1.0),
                              lengths=LengthControls(llm_tokens=36, audio_frames=60))
                for i, text in enumerate(["Tell me about rivers.", "What is the tallest mountain?"])]

    def answers(overlap: bool) -> tuple[list[str], int]:
        options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                                max_slots=4, max_chat_slots=3, tts_max_positions=1024,
                                llm_max_positions=256, overlap_llm_step=overlap)
        engine = MiniCPMOEngine(model, options)
        try:
            async def run() -> list[str]:
                return await asyncio.gather(*(spoken_text(s) for s in engine.submit(requests)))

            return asyncio.run(run()), engine.device_work().get("llm_launches", 0)
        finally:
            engine.close()

    in_line, no_launches = answers(False)
    overlapped, launches = answers(True)
    assert no_launches == 0 and launches > 0
    assert overlapped == in_line and all(in_line)
