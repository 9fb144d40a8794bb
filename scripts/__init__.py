"""The commands a user runs: set up (``scripts/setup``), serve (``scripts/serve``, its
``serve_run.py``), test (``scripts/test``), lock (``scripts/lock``, ``deps_hash.py``), bring
wheels to a GPU machine (``scripts/gpu_wheels``), write the Kubernetes manifests
(``python -m scripts.write_rayservices``, its ``kuberay_*.py`` parts), and the short wrappers
of the benchmarks (``bench/``), the fleet scenarios (``fleet/``), the load test (``loadtest/``)
and the soak (``soak/``).

The Python ones run as modules from the repository root (``python -m scripts.x``), importing
``serve_app`` from the checkout without path edits; the shell ones are run by path.
"""
