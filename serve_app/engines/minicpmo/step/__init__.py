"""The parts of the engine step that :mod:`..step_loop` runs in the order plan -> launch -> collect:
admission (its prefill), chat text (LLM steps), text intake (pieces into TTS work), stream
endings, and the step's bookkeeping (step record, phase timing, GC clock, fault injection)."""
