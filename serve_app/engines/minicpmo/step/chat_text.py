"""The LLM side of a step: chat streams' text, one token per stream per LLM step, run in the
step (:meth:`ChatTextSteps.decode`) or, with ``overlap_llm_step``, launched beside the audio
window and collected after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..chat import ChatText
from ..device.runner import ModelRunner
from ..options import EngineOptions
from ..scheduler import Scheduler, Stream
from ..speech_schedule import Phase


@dataclass(slots=True)
class LaunchedText:
    """An LLM step queued on the device for ``streams``; its tokens are read later."""

    streams: list[Stream]
    launched: object  # the runner's handle (ModelRunner.llm_launch)


def waiting_for_text(streams: Sequence[Stream]) -> bool:
    """Some stream's speech waits for its next piece of text."""
    return any(not s.pieces and not s.text_done and s.schedule.phase is Phase.WAITING_TEXT
               for s in streams)


class ChatTextSteps:
    """The chat streams' LLM steps and the tokens they give (into :class:`ChatText`)."""

    def __init__(self, options: EngineOptions, scheduler: Scheduler, runner: ModelRunner,
                 chat: ChatText) -> None:
        self.options = options
        self.scheduler = scheduler
        self.runner = runner
        self.chat = chat
        # admitted chat streams whose first tokens are on their way (the runner's handle)
        self._first_tokens: list[tuple[list[Stream], object]] = []

    def rows(self) -> list[Stream]:
        """Chat streams that want their next LLM token (:meth:`wants_token`)."""
        return [s for s in self.scheduler.running() if self.wants_token(s)]

    def wants_token(self, s: Stream) -> bool:
        """A chat stream whose text is not done, below the lookahead (and past its first
        token: one still on its way has no ``next_token``)."""
        return (s.plan.is_chat and not s.text_done and s.llm_slot >= 0
                and s.schedule is not None and s.next_token is not None
                and len(s.pieces) < self.options.llm_lookahead_pieces)

    def hold_first_tokens(self, streams: list[Stream], launched: object) -> None:
        """Admitted chat streams' first tokens, launched by the runner, to take later."""
        self._first_tokens.append((streams, launched))

    def holds_first_tokens(self) -> bool:
        """Some admitted chat stream's first token is on its way (not taken yet)."""
        return bool(self._first_tokens)

    def take_first_tokens(self, counted_as: str | None = None) -> None:
        """The held first tokens into their streams (waits for them); a stream that ended
        since (its LLM slot given back) takes none. ``counted_as``: the device-work counter
        that records where in the step they were taken (once per step that took some)."""
        held, self._first_tokens = self._first_tokens, []
        if held and counted_as is not None:
            self.runner.work.update(**{counted_as: 1})
        for streams, launched in held:
            for stream, token in zip(streams, self.runner.collect_first_tokens(launched)):
                if stream.llm_slot >= 0:
                    self.accept_token(stream, token)

    def overlaps(self) -> bool:
        """With ``overlap_llm_step``, while some stream's audio is generating and a chat stream
        wants its next token: the step's LLM step is launched beside its audio window
        (:meth:`launch`), not run in its plan (:meth:`decode`)."""
        running = self.scheduler.running()
        return (self.options.overlap_llm_step
                and any(s.schedule is not None and s.schedule.phase is Phase.GENERATING
                        for s in running)
                and any(self.wants_token(s) for s in running))

    def launch(self, beside_window: bool) -> LaunchedText | None:
        """One LLM step launched (right after the step's audio window is queued, with
        ``beside_window``: it runs beside it) and collected after the window (:meth:`collect`),
        or, while a chat stream's speech waits for text, first, with more steps beside the
        window (:meth:`beside_window`)."""
        streams = self.rows()
        if not streams:
            return None
        launched = self.runner.llm_launch([s.llm_slot for s in streams], self.chat.inputs(streams),
                                          beside_window=beside_window)
        return LaunchedText(streams, launched)

    def collect(self, text: LaunchedText) -> None:
        """The launched LLM step's tokens (waits for them)."""
        self._take_tokens(text.streams, self.runner.llm_collect(text.launched))

    def beside_window(self, text: LaunchedText | None) -> None:
        """The launched LLM step's tokens (if one was launched) and the first tokens of chat
        streams admitted beside the window (``first_text_beside_window``), then, while a
        stream's speech waits for text, more steps (up to ``steps_per_sync`` in all), each
        launched beside the audio window queued last: the running streams' audio is not held up
        by text that only the waiting streams need now (their pieces are read next step)."""
        if text is not None:
            self.collect(text)
        if self.options.first_text_beside_window:
            self.take_first_tokens(counted_as="first_tokens_beside_window")
        for _ in range(self.options.steps_per_sync - 1):
            streams = self.rows()
            if not streams or not waiting_for_text(streams):
                return
            self.collect(LaunchedText(streams, self.runner.llm_launch(
                [s.llm_slot for s in streams], self.chat.inputs(streams), beside_window=True)))

    def decode(self) -> None:
        """One batched LLM step for every chat stream below its lookahead; more steps (up to
        ``steps_per_sync``) while a stream's speech waits for its next piece."""
        for _ in range(self.options.steps_per_sync):
            streams = self.rows()
            if not streams:
                return
            self._take_tokens(streams, self.runner.llm_step([s.llm_slot for s in streams],
                                                            self.chat.inputs(streams)))
            if not waiting_for_text(streams):
                return

    def accept_token(self, stream: Stream, token: int) -> None:
        """A token into the stream's text; the stream's LLM slot is freed when its text ends."""
        if self.chat.accept(stream, token):
            self.scheduler.free_llm_slot(stream)

    def _take_tokens(self, streams: list[Stream], tokens: list[int]) -> None:
        """One LLM step's tokens into its streams (one whose LLM slot was freed since, when the
        step was launched earlier in the engine step, takes none)."""
        self.scheduler.count(llm_steps=1)
        for stream, token in zip(streams, tokens):
            stream.llm_len += 1
            if stream.llm_slot >= 0:
                self.accept_token(stream, token)
