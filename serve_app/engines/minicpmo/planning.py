"""Requests to plans, in the caller's thread: a request is checked against what the engine serves
(:meth:`RequestPlanner.validate`), then tokenized into the :class:`~.scheduler.StreamPlan` the
step thread runs (the step thread never tokenizes), with the input tokens its usage reports."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..base import TEXT_INPUTS, InvalidRequestError, SpeechRequest
from ..text_rule import MAX_TEXT_CHARS, check_text
from .scheduler import StreamPlan
from .text import (
    PIECE_TOKENS,
    READ_INSTRUCTION,
    TextFeed,
    cut_into_pieces,
    has_speakable_text,
    user_turn,
)
from .voices import DEFAULT_VOICE, VoiceTable


def prompt_text(request: SpeechRequest) -> str:
    """The user turn whose hidden state gives the stream's speaker embedding."""
    if request.mode == "read":
        return user_turn(READ_INSTRUCTION + request.text, request.system_prompt)
    return user_turn(request.text, request.system_prompt)


class RequestPlanner:
    """Validation and tokenization of requests (``MiniCPMOEngine.validate``, ``plan``)."""

    def __init__(self, tokenizer, gen_prompt_ids: Sequence[int], voices: VoiceTable,
                 llm_max_positions: int, modes: Sequence[str]) -> None:
        self._tok = tokenizer
        self._gen_prompt_ids = gen_prompt_ids
        self._voices = voices
        self._llm_max_positions = llm_max_positions
        self._modes = modes

    def ids(self, text: str) -> list[int]:
        """LLM token ids of ``text`` (no special tokens added)."""
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def count_tokens(self, text: str) -> int:
        return len(self.ids(text))

    def validate(self, request: SpeechRequest) -> None:
        text = request.text
        streamed = request.text_input == "streamed"
        if request.text_input not in TEXT_INPUTS:
            raise InvalidRequestError(f"unknown text_input {request.text_input!r}", "text_input")
        if streamed and request.mode != "read":
            raise InvalidRequestError("streamed text input needs mode 'read'", "text_input",
                                      code="unsupported_text_input")
        if not streamed:
            check_text(text)  # the shared rule (serve_app.engines.text_rule)
        elif len(text) > MAX_TEXT_CHARS:
            raise InvalidRequestError(f"text is longer than {MAX_TEXT_CHARS} characters", "text",
                                      code="text_too_long")
        if request.mode not in self._modes:
            raise InvalidRequestError(f"unknown mode {request.mode!r}", "mode")
        if request.mode == "read" and not streamed and not has_speakable_text(text):
            raise InvalidRequestError("text holds nothing speakable (no letters or digits)", "text",
                                      code="nothing_to_speak")
        if request.voice != DEFAULT_VOICE:
            self._voices.prefix_length(request.voice)  # raises voice_not_found
        if request.speed != 1.0:
            raise InvalidRequestError("this engine speaks at speed 1.0 only", "speed")
        request.sampling.validate()
        if request.mode == "chat":
            prompt_tokens = self.count_tokens(prompt_text(request))
            voice_tokens = (self._voices.prefix_length(request.voice)
                            if request.voice != DEFAULT_VOICE else 0)
            self.check_chat_room(voice_tokens + prompt_tokens)

    def check_chat_room(self, prompt_tokens: int) -> None:
        """A chat answer needs room in the LLM cache after its prompt (voice turn included)."""
        budget = self._llm_max_positions - prompt_tokens - len(self._gen_prompt_ids)
        if budget < PIECE_TOKENS + 1:
            raise InvalidRequestError("text is too long for a chat turn", "text",
                                      code="text_too_long")

    def plan(self, request: SpeechRequest) -> StreamPlan:
        prompt = prompt_text(request)
        decode = self._tok.decode
        prompt_ids = self.ids(prompt)
        instructions = self.count_tokens(request.system_prompt or "")  # usage's input tokens
        if request.text_input == "streamed":
            feed = TextFeed(self.ids, decode)
            return StreamPlan(request, prompt, feed.push(request.text), text_feed=feed,
                              prompt_ids=prompt_ids, input_tokens=instructions)
        if request.mode == "read":
            ids = self.ids(request.text)
            return StreamPlan(request, prompt, cut_into_pieces(ids, decode),
                              prompt_ids=prompt_ids, input_tokens=instructions + len(ids))
        return StreamPlan(request, prompt, None, prompt_ids=prompt_ids,
                          input_tokens=instructions + self.count_tokens(request.text))

    def with_prompt_ids(self, plans: Sequence[StreamPlan]) -> list[StreamPlan]:
        """``plans``, each carrying its prompt's ids (tokenized here for those made without)."""
        return [plan if plan.prompt_ids is not None else
                replace(plan, prompt_ids=self.ids(plan.prompt)) for plan in plans]
