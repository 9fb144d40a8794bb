"""The scripts in scripts/ run as modules from the repository root (``python -m scripts.x``):
no ``sys.path`` edits, and they import ``serve_app``, ``scripts`` and ``tests`` from the checkout
without the project installed, as the GPU machine runs them (``PYTHONPATH`` holding only the
dependencies)."""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_SCRIPTS = ["bench_engine", "bench_engine_wire", "bench_int4_kernels",
                  "check_batch_invariance", "llm_attention_numerics", "profile_audio_step",
                  "project_gpu", "quant_accuracy", "roofline"]


def test_no_script_edits_sys_path():
    edits = [f"{path.name}:{number}" for path in sorted((ROOT / "scripts").glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bsys\.path\.(insert|append)\b", line)]
    assert not edits, f"scripts that edit sys.path (run them as python -m scripts.x): {edits}"


def test_scripts_import_from_the_repo_root_without_the_project_installed():
    pytest.importorskip("torch")
    # -S: no site processing, so the editable install's path hook is not loaded; the
    # dependencies come from PYTHONPATH as on the GPU machine, the project from the cwd.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    code = ("import serve_app, sys; assert serve_app.__file__.startswith(sys.argv[1]), "
            "serve_app.__file__\n"
            + "".join(f"import scripts.{name}\n" for name in MODULE_SCRIPTS))
    result = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
