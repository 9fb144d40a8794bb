"""How fast and how exact, measured: one folder per benchmark.

- ``engine/``: the MiniCPM-o engine alone, no Ray (``python -m bench.engine.run``); the engine ->
  replica hop on the CPU (``bench.engine.wire``); a run's roofline and its projection onto
  another GPU.
- ``served/``: the whole service (``serve run``) under Locust, beside the engine alone
  (``scripts/bench_serve``); word timestamps' cost (``scripts/bench_timestamps``); capacity per
  replica; the CPU profile's TTFB.
- ``overload/``: offered load past capacity, served (``scripts/bench_overload``) and on the
  engine alone (``bench.overload.engine``).
- ``autoscale/``: Synthesizer replicas scaling under a Locust ramp on GPUs
  (``scripts/bench_autoscale``).
- ``kernels/``: one kernel or the audio window alone on a GPU.
- ``accuracy/``: how far a faster path moves the model's output (fp8 cache, visible-ranges
  attention, int4, batching) and how exact Piper's word times are.

Run as modules from the repository root (``python -m bench.engine.run --help``): they import
``serve_app``, ``harness``, ``loadtest`` and ``tests`` from the checkout without installing the
project, as the GPU machine runs them. Results go to ``docs/benchmarks/``.
"""
