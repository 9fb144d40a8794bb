"""Run a test's measurement in a Python process of its own.

For what must not share the suite's process: ``tracemalloc`` traces every thread's allocations
once started, and in the suite's process native threads left by earlier tests (Ray's, with no
Python frame) allocate too; CPython 3.11's tracemalloc crashed the whole run there (SIGSEGV in
its ``traceback_new``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def call_in_own_process(module: str, function: str, timeout_s: float = 300.0):
    """``module.function()`` called in a new interpreter (cwd: the repository root); its
    result, a Python literal, comes back through its ``repr``."""
    code = f"from {module} import {function} as f; print(repr(f()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stderr[-3000:]
    return ast.literal_eval(run.stdout.strip().splitlines()[-1])
