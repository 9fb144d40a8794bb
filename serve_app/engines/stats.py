"""The counters every engine keeps (:class:`EngineStats`), in a leaf module: the synthesizer
exports them as metrics, its autoscaling and routing signals read them, tests read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters the synthesizer exports as metrics and tests read."""

    active_streams: int = 0
    queued_streams: int = 0
    max_slots: int = 0
    steps: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    last_batch_size: int = 0
    max_batch_size_seen: int = 0
    step_seconds: float = 0.0  # wall time spent running steps: the engine's busy time
    step_cpu_seconds: float = 0.0  # CPU time the step thread spent in them: its host work
    llm_steps: int = 0  # batched LLM decode steps (chat text) run inside engine steps
    device_memory_peak_bytes: int = 0  # most GPU memory the engine's allocator has held (0: CPU)
    # The audio each generating stream gets from one step: a step that takes longer falls behind
    # real time (0: the engine's steps have no fixed budget). The autoscaling policy reads it.
    step_budget_s: float = 0.0
    # Admission by work (serve_app/engines/work_admission.py): the load committed now (admitted
    # and queued streams' projected share of the real-time budget), the limit it is kept under,
    # one more stream's load by kind, admissions and refusals by reason, and the refused
    # streams' load (demand the autoscaler counts). 0 where the engine admits by slots alone.
    work_load: float = 0.0
    work_limit: float = 0.0
    measured_load: float = 0.0  # the last steps' load as measured (EWMA)
    read_stream_load: float = 0.0
    chat_stream_load: float = 0.0
    cloned_stream_load: float = 0.0
    streamed_stream_load: float = 0.0
    admitted_streams: int = 0
    refused_work: int = 0
    refused_wait: int = 0
    refused_queue: int = 0
    refused_behind: int = 0
    refused_slots: int = 0
    ran_dry_chunks: int = 0  # chunks that came after their listener had played all it had
    refused_load: float = 0.0
    # slots neither running nor promised to a queued stream, where a stream without one is
    # refused (MiniCPM-o admitting by work); -1 where the engine queues instead (Piper)
    free_slots: int = -1

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)

    def with_work(self, work: dict[str, float]) -> "EngineStats":
        """These stats with an admission's snapshot (WorkAdmission.snapshot) in them."""
        for name, value in work.items():
            setattr(self, name, value)
        return self

    def has_room(self, kind: str = "read") -> bool:
        """Whether one more stream of ``kind`` fits (always, where the engine admits by slots:
        its queue decides; and where it holds no stream: an idle engine takes what comes)."""
        return (self.work_limit <= 0 or self.headroom(kind) >= 1
                or self.active_streams + self.queued_streams == 0)

    def headroom(self, kind: str = "read") -> float:
        """How many more streams of ``kind`` fit the real-time budget now (0 when none; a large
        number where the engine admits by slots alone)."""
        room = self._work_room(kind)
        if self.work_limit <= 0 or room is None:
            return float(max(self.max_slots - self.active_streams - self.queued_streams, 0))
        return room if self.free_slots < 0 else min(room, float(self.free_slots))

    def refusal_reason(self, kind: str = "read") -> str:
        """Why one more stream of ``kind`` does not fit (:meth:`has_room` is False)."""
        room = self._work_room(kind)
        return "work" if room is not None and room < 1 else "slots"

    def _work_room(self, kind: str) -> float | None:
        """Streams of ``kind`` the real-time budget has room for (None: no cost known)."""
        cost = getattr(self, f"{kind}_stream_load", 0.0)
        return max((self.work_limit - self.work_load) / cost, 0.0) if cost > 0 else None
