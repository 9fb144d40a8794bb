"""The device work of one engine step: the runner that owns the per-slot tensors, the audio and
LLM steps, CUDA graphs, sampling and the host/device copies that do not wait for the device.
The scheduling core (one level up) decides what runs; these modules run it."""
