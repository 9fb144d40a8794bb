"""Measuring and checking scripts, run as modules from the repository root so that they import
``serve_app``, ``tests`` and each other without path edits and without installing the project
(the GPU machine runs them that way)::

    python -m scripts.bench_engine --help

The shell wrappers here (``scripts/serve``, ``scripts/test``, ...) are run by path.
"""
