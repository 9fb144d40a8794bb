"""The measuring code (bench/, fleet/, harness/, loadtest/, soak/) and scripts/ run as modules
from the repository root (``python -m bench.engine.run``): no ``sys.path`` edits, and the
benchmarks import ``serve_app``, ``harness``, ``loadtest``, ``tests`` and each other from the
checkout without the project installed, as the GPU machine runs them (``PYTHONPATH`` holding only
the dependencies)."""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["bench", "fleet", "harness", "loadtest", "soak", "scripts"]
# Locust imports its locustfile by path, not as a module: it puts the root on sys.path itself.
LOADED_BY_PATH = {"loadtest/locustfile.py"}


def modules_under(folder: str) -> list[str]:
    """Every module of ``folder`` as ``python -m`` names it."""
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for path in (ROOT / folder).rglob("*.py"))


def test_no_module_edits_sys_path():
    edits = [f"{path.relative_to(ROOT)}:{number}" for folder in FOLDERS
             for path in sorted((ROOT / folder).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in LOADED_BY_PATH
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bsys\.path\.(insert|append)\b", line)]
    assert not edits, f"modules that edit sys.path (run them as python -m folder.x): {edits}"


def test_benchmarks_import_from_the_repo_root_without_the_project_installed():
    pytest.importorskip("torch")
    # -S: no site processing, so the editable install's path hook is not loaded; the
    # dependencies come from PYTHONPATH as on the GPU machine, the project from the cwd.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    code = ("import serve_app, sys; assert serve_app.__file__.startswith(sys.argv[1]), "
            "serve_app.__file__\n"
            + "".join(f"import {name}\n" for name in modules_under("bench")))
    result = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
