"""serveConfigV2 for a RayService: a shipped serve config's text, comments kept, with the few
values a Kubernetes cluster needs changed line by line (scripts/write_rayservices.py lists them
in each manifest's header).
"""

from __future__ import annotations

import re

NOTE = "(scripts/write_rayservices)"


def _set_line(lines: list[str], start: int, end: int, key: str, value: str, note: str,
              where: str) -> None:
    """Set ``key: value`` on the one line in ``lines[start:end]`` that holds that key (comments
    excluded); ValueError where there is none or more than one."""
    pattern = re.compile(rf"^(\s+){re.escape(key)}:[^\n]*$")
    found = [i for i in range(start, end) if pattern.match(lines[i])]
    if len(found) != 1:
        raise ValueError(f"{where}: expected one {key} line, found {len(found)}")
    indent = pattern.match(lines[found[0]]).group(1)
    lines[found[0]] = f"{indent}{key}: {value}   # {note} {NOTE}"


def _insert_after(lines: list[str], start: int, end: int, key: str, new_key: str, value: str,
                  note: str, where: str) -> None:
    """Add ``new_key: value`` below the ``key`` line of ``lines[start:end]``, same indent."""
    pattern = re.compile(rf"^(\s+){re.escape(key)}:[^\n]*$")
    found = [i for i in range(start, end) if pattern.match(lines[i])]
    if len(found) != 1:
        raise ValueError(f"{where}: expected one {key} line, found {len(found)}")
    indent = pattern.match(lines[found[0]]).group(1)
    lines.insert(found[0] + 1, f"{indent}{new_key}: {value}   # {note} {NOTE}")


def _block(lines: list[str], deployment: str, where: str) -> tuple[int, int]:
    """The lines of one deployment's entry: from its ``- name:`` to the next entry's."""
    heads = [i for i, line in enumerate(lines) if re.match(r"^\s+- name: \w+", line)]
    starts = [i for i in heads if lines[i].split("name:")[1].split("#")[0].strip() == deployment]
    if len(starts) != 1:
        raise ValueError(f"{where}: expected one deployment {deployment}")
    later = [i for i in heads if i > starts[0]]
    return starts[0], later[0] if later else len(lines)


def edited(text: str, where: str, values: dict[str, str],
           deployment_values: dict[str, dict[str, str]],
           initial_replicas: dict[str, int] | None = None) -> str:
    """``text`` with each top-level key of ``values`` (``api.voice_store`` written as
    ``voice_store``: every such key is unique in a shipped config) set, each deployment's
    ``deployment_values`` set inside its own entry, and ``initial_replicas`` added under each
    named deployment's ``min_replicas``. Each changed line says so in its comment."""
    lines = text.split("\n")
    for key, value in values.items():
        _set_line(lines, 0, len(lines), key, value, "set for Kubernetes", where)
    for deployment, settings in deployment_values.items():
        for key, value in settings.items():
            start, end = _block(lines, deployment, where)
            _set_line(lines, start, end, key, value, "set for Kubernetes", where)
    for deployment, replicas in (initial_replicas or {}).items():
        start, end = _block(lines, deployment, where)
        _insert_after(lines, start, end, "min_replicas", "initial_replicas", str(replicas),
                      "the running cluster's size, for a rollout", where)
    return "\n".join(lines)
