"""The README's commands run as written on a fresh clone.

Every line of the README's shell blocks must be one of: the two scripts (present and executable),
``curl`` against a route the app serves (``serve_app.front.ingress.api_app``) with the method it
answers, ``.venv/bin/<entry point>`` of the project (``[project.scripts]``) or of one of its
dependencies (Ray's ``serve``), ``.venv/bin/python <example>`` whose imports (and those of the
package beside it that it imports, ``examples/NAME/``) the installed set provides, or ``echo``. A
file a command reads is in the repository or written by a line before it, and what a command saves
goes into /tmp, never into the checkout (where git would list it). ``.venv/bin/...`` is what the
set-up scripts make (``scripts/setup``); the packages an example imports must be in every lock
``scripts/serve`` may install (``requirements/``), those of the examples on a voice-agent framework
(:data:`FRAMEWORK_EXAMPLES`) and of the README's Python block in the lock ``scripts/test``
installs. The cheap commands run (``--help``); the slow test runs the README's lines against the
CPU profile as ``scripts/serve`` serves it (the session's one, ``tests/cpu_profile.py``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
SERVICE = "127.0.0.1:8000"  # where the README's commands find the service
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", "$(", "`"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
BUILTINS = {"echo"}
# Examples built on a voice-agent framework (Pipecat, LiveKit Agents): the frameworks come with
# the test set, which scripts/test installs into .venv (the README says so), not with the
# service's.
FRAMEWORK_EXAMPLES = {"examples/pipecat_tts.py", "examples/livekit_tts.py"}
# The packages beside the examples (examples/NAME/) that an example imports: their imports are
# the example's.
EXAMPLE_PACKAGES = {path.parent.name for path in (ROOT / "examples").glob("*/__init__.py")}


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


@dataclass
class Command:
    """One simple command of a README shell line: its words, where it writes, what it reads."""

    line: str
    argv: list[str]
    writes: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)


def logical_lines(block: str) -> list[str]:
    """The block's lines with continuations (a trailing backslash) joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def simple_commands(line: str) -> list[Command]:
    """``line`` split into simple commands at pipes, lists and command substitutions, without
    comments, variable assignments and redirections (their files are kept apart)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    commands, current = [], Command(line, [])
    index = 0
    while index < len(words):
        word = words[index]
        if word.endswith("$") and index + 1 < len(words) and words[index + 1] == "(":
            word = word[:-1]  # name=$( ... ): the substitution is a command of its own
        if word in OPERATORS:
            if current.argv:
                commands.append(current)
            current = Command(line, [])
        elif word in REDIRECTS:
            index += 1
            (current.reads if word == "<" else current.writes).append(words[index])
        elif not current.argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
            pass  # an assignment before the command (NAME=value cmd, name=$(cmd))
        elif word:
            current.argv.append(word)
        index += 1
    if current.argv:
        commands.append(current)
    for command in commands:
        argv = command.argv
        for option, target in zip(argv, argv[1:]):
            if option in ("-o", "--output", "--out"):
                command.writes.append(target)
            elif option in ("--text-file",):
                command.reads.append(target)
            elif option in ("-F", "--form", "-d", "--data") and "=@" in target:
                command.reads.append(target.split("=@", 1)[1])
        if argv[1:3] == ["voices", "create"] and len(argv) > 3:
            command.reads.append(argv[3])
    return commands


def readme_commands() -> list[Command]:
    text = README.read_text(encoding="utf-8")
    return [command for block in fenced_blocks(text, "bash") for line in logical_lines(block)
            for command in simple_commands(line)]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def api_routes() -> list[tuple[re.Pattern, set[str]]]:
    """(path pattern, methods) of every route the app serves; WebSocket routes as ``WS``."""
    from fastapi.routing import APIWebSocketRoute

    from serve_app.front.ingress import api_app

    found = []

    def walk(routes) -> None:
        for route in routes:
            if hasattr(route, "original_router"):  # an included router (FastAPI >= 0.16x)
                walk(route.original_router.routes)
            elif hasattr(route, "routes") and not hasattr(route, "path_regex"):
                walk(route.routes)
            elif hasattr(route, "path"):
                methods = {"WS"} if isinstance(route, APIWebSocketRoute) else set(
                    getattr(route, "methods", None) or ())
                pattern = re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(route.path))
                found.append((re.compile(pattern + "$"), methods))

    walk(api_app.routes)
    return found


def route_answers(routes, path: str, method: str) -> bool:
    return any(pattern.match(path) and method in methods for pattern, methods in routes)


def curl_method(argv: list[str]) -> str:
    for option, value in zip(argv, argv[1:]):
        if option in ("-X", "--request"):
            return value
    data = {"-d", "--data", "--data-binary", "-F", "--form"}
    return "POST" if data & set(argv) else "GET"


def urls(argv: list[str]) -> list[str]:
    return [word for word in argv if "://" in word]


# ---- what the set-up installs ---------------------------------------------------------------


def setup_locks(script: str) -> list[Path]:
    """The locks ``scripts/<script>`` may install: one per ``scripts/setup EXTRAS`` it calls."""
    text = (ROOT / "scripts" / script).read_text(encoding="utf-8")
    extras = re.findall(r"scripts/setup\s+([\w,+-]+)", text)
    assert extras, f"scripts/{script} calls no scripts/setup"
    return [ROOT / "requirements" / f"{sets.replace(',', '+')}.txt" for sets in extras]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock: Path) -> set[str]:
    names = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock.read_text(encoding="utf-8"), re.M)
    return {normalized(name) for name in names}


def top_level_imports(source: str) -> set[str]:
    """The top-level modules ``source`` imports (relative imports aside)."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def third_party_imports(source: str) -> set[str]:
    """Top-level modules ``source`` imports that are neither the standard library nor ours."""
    ours = {"serve_app", "loadtest", "tests", "__future__", *EXAMPLE_PACKAGES}
    return {module for module in top_level_imports(source)
            if module not in sys.stdlib_module_names and module not in ours}


def distributions_of(modules: set[str]) -> dict[str, set[str]]:
    """Module -> the installed distributions that provide it (empty: nothing installed does)."""
    provided = importlib.metadata.packages_distributions()
    return {module: {normalized(name) for name in provided.get(module, ())}
            for module in modules}


def example_package_files(source: str) -> list[Path]:
    """The modules of the example packages (:data:`EXAMPLE_PACKAGES`) ``source`` imports."""
    return sorted(path for package in EXAMPLE_PACKAGES & top_level_imports(source)
                  for path in (ROOT / "examples" / package).rglob("*.py"))


def assert_imports_locked(source: str, what: str, locks: list[Path]) -> None:
    for module, dists in distributions_of(third_party_imports(source)).items():
        assert dists, f"{what} imports {module}, which no installed package provides"
        for lock in locks:
            assert dists & locked(lock), (
                f"{what} imports {module} ({sorted(dists)}), which requirements/{lock.name} "
                f"does not install")


def dependency_entry_points() -> set[str]:
    """Console scripts of the installed distributions the project depends on (directly)."""
    names = set()
    for requirement in project()["dependencies"]:
        dist = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        try:
            entry_points = importlib.metadata.distribution(dist).entry_points
        except importlib.metadata.PackageNotFoundError:
            continue
        names.update(ep.name for ep in entry_points if ep.group == "console_scripts")
    return names


# ---- the README's commands ------------------------------------------------------------------


def test_the_readme_opens_with_the_two_commands():
    first = fenced_blocks(README.read_text(encoding="utf-8"), "bash")[0]
    assert [line.split()[0] for line in logical_lines(first)] == ["scripts/serve", "scripts/test"]
    assert README.read_text(encoding="utf-8").index("http://127.0.0.1:8000/") < 2000, (
        "the web page is mentioned early")


def test_every_command_is_one_the_repository_provides():
    routes = api_routes()
    entry_points = set(project()["scripts"])
    dependency_scripts = dependency_entry_points()
    written: set[str] = set()
    commands = readme_commands()
    assert len(commands) >= 8
    for command in commands:
        program, args = command.argv[0], command.argv[1:]
        where = f"README line {command.line!r}"
        for path in command.reads:
            assert (ROOT / path).is_file() or path in written, (
                f"{where} reads {path}, which neither the repository nor an earlier line has")
        if program in ("scripts/serve", "scripts/test"):
            assert os.access(ROOT / program, os.X_OK), f"{program} is not executable"
            assert not args, where
        elif program == "curl":
            assert urls(command.argv), f"{where}: curl without a URL"
            for url in urls(command.argv):
                parsed = urlparse(url)
                assert parsed.netloc == SERVICE, f"{where}: not the service ({parsed.netloc})"
                method = curl_method(command.argv)
                assert route_answers(routes, parsed.path, method), (
                    f"{where}: the app has no {method} {parsed.path}")
        elif program.startswith(".venv/bin/"):
            name = program.removeprefix(".venv/bin/")
            if name == "python":
                script = args[0]
                assert script.startswith("examples/") and (ROOT / script).is_file(), where
                source = (ROOT / script).read_text(encoding="utf-8")
                locks = setup_locks("test" if script in FRAMEWORK_EXAMPLES else "serve")
                assert_imports_locked(source, script, locks)
                for path in example_package_files(source):
                    assert_imports_locked(path.read_text(encoding="utf-8"), str(path), locks)
                for url in urls(args):
                    parsed = urlparse(url)
                    assert parsed.netloc == SERVICE, where
                    expected = "WS" if parsed.scheme.startswith("ws") else "GET"
                    assert route_answers(routes, parsed.path, expected), (
                        f"{where}: the app has no {expected} {parsed.path}")
            else:
                assert name in entry_points or name in dependency_scripts, (
                    f"{where}: {name} is neither the project's entry point "
                    f"({sorted(entry_points)}) nor one of its dependencies'")
                for config in [arg for arg in args if arg.endswith(".yaml")]:
                    assert (ROOT / config).is_file(), where
        else:
            assert program in BUILTINS, f"{where}: {program} is not provided by a fresh clone"
        written.update(command.writes)


def test_the_python_block_uses_what_scripts_test_installs():
    blocks = fenced_blocks(README.read_text(encoding="utf-8"), "python")
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")
        assert_imports_locked(block, "the README's Python block", setup_locks("test"))
        assert SERVICE in block


def test_what_the_commands_save_goes_to_tmp_not_into_the_checkout():
    commands = readme_commands()
    saved = [path for command in commands for path in command.writes]
    assert saved
    assert [path for path in saved if not path.startswith("/tmp/")] == []
    for block in fenced_blocks(README.read_text(encoding="utf-8"), "python"):
        for call in ast.walk(ast.parse(block)):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "stream_to_file":
                assert ast.literal_eval(call.args[0]).startswith("/tmp/"), ast.unparse(call)


def test_the_examples_are_covered():
    """Every example the repository ships is one the README runs."""
    run = {command.argv[1] for command in readme_commands()
           if command.argv[0] == ".venv/bin/python"}
    assert run == {str(path.relative_to(ROOT)) for path in (ROOT / "examples").glob("*.py")}


needs_venv = pytest.mark.skipif(not (VENV_BIN / "python").exists(),
                                reason="no .venv here (scripts/setup makes it)")


@needs_venv
def test_the_entry_points_and_examples_start():
    """``--help`` of every ``.venv/bin`` program and example the README runs: they import."""
    seen = set()
    for command in readme_commands():
        program = command.argv[0]
        if not program.startswith(".venv/bin/"):
            continue
        argv = command.argv[:2] if program.endswith("/python") else command.argv[:1]
        if tuple(argv) in seen:
            continue
        seen.add(tuple(argv))
        done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        assert done.returncode == 0, f"{' '.join(argv)} --help: {done.stderr[-2000:]}"
        assert "usage" in done.stdout.lower(), done.stdout[:500]


# ---- the README's commands against the CPU profile -------------------------------------------


def engine_only_block(block: str) -> bool:
    """The voices block: MiniCPM-o only (Piper answers 422)."""
    return "/v1/audio/voices" in block


@pytest.mark.slow
@needs_venv
def test_the_readme_runs_against_the_cpu_profile(cpu_service, tmp_path):
    """The README's lines against the CPU profile as scripts/serve serves it (the session's
    one, tests/cpu_profile.py)."""
    import soundfile

    port = cpu_service.port
    # The README's commands, from a folder of their own that sees the clone's .venv and examples.
    work = tmp_path / "clone"
    work.mkdir()
    for name in (".venv", "examples", "scripts"):
        (work / name).symlink_to(ROOT / name)
    text = README.read_text(encoding="utf-8")
    for block in fenced_blocks(text, "bash"):
        if engine_only_block(block):
            continue
        for line in logical_lines(block):
            program = simple_commands(line)[0].argv[0]
            if program in ("scripts/serve", "scripts/test") or program.endswith("/serve"):
                continue  # the service itself (the session's, running) and the suite
            # /tmp/NAME becomes the test's own folder: beside other runs on this machine.
            line = line.replace(SERVICE, f"127.0.0.1:{port}").replace("/tmp/", f"{work}/")
            # tts-client's default --url is the service's usual address; here TTS_URL moves it
            done = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=work,
                                  capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "TTS_URL": f"http://127.0.0.1:{port}"})
            assert done.returncode == 0, f"{line}\n{done.stdout[-1000:]}{done.stderr[-2000:]}"
            if "--help" not in line and "voice_agent" not in line:
                for written in simple_commands(line)[-1].writes:
                    assert (work / written).stat().st_size > 0, line
    for name in ("hello.wav", "native.wav", "terminal.wav"):
        audio, rate = soundfile.read(work / name)
        assert len(audio) > rate // 2, name  # half a second of speech at least
    mp3 = (work / "stdin.mp3").read_bytes()
    assert mp3[:3] == b"ID3" or (mp3[0] == 0xFF and mp3[1] & 0xE0 == 0xE0), mp3[:4]  # a frame
    assert (work / "agent.pcm").stat().st_size > 24000, "the voice agent got no audio"
    # The OpenAI SDK block, where scripts/test has installed the SDK.
    if shutil.which("python", path=str(VENV_BIN)) and _has(VENV_BIN / "python", "openai"):
        [block] = fenced_blocks(text, "python")
        (work / "hello_openai.py").write_text(
            block.replace(SERVICE, f"127.0.0.1:{port}").replace("/tmp/", f"{work}/"))
        done = subprocess.run([str(work / ".venv/bin/python"), "hello_openai.py"], cwd=work,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert (work / "hello.mp3").stat().st_size > 1000


def _has(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0
