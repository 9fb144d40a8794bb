"""How far a faster path moves the output: the fp8 TTS cache, visible-ranges attention in the
chat LLM, int4 weights, batching; and how exact Piper's word timestamps are."""
