"""Synthesizer replicas scaling on the engine's own queue under a Locust ramp, on GPUs
(``scripts/bench_autoscale``)."""
