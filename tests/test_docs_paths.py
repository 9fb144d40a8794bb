"""The docs that walk the code name files and symbols that exist: a file moved or a function
renamed without its docs fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/architecture.md", "docs/minicpmo.md", "DEVELOPERS.md"]
# Where a path the docs write relative to a package is looked up, in order.
BASES = ["", "serve_app", "serve_app/engines", "serve_app/engines/minicpmo"]
SEARCHED = ["serve_app", "scripts", "bench", "fleet", "harness", "loadtest", "soak", "tests", "examples"]
# `path/to/file.py` or `file.py`, optionally `:Symbol.attr` (or `: symbol`).
REFERENCE = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.(?:py|yaml|html))(?::\s?([A-Za-z_][\w.]*))?")


def _resolve(name: str) -> Path | None:
    if "/" in name:
        for base in BASES:
            candidate = ROOT / base / name
            if candidate.is_file():
                return candidate
        return None
    found = [path for folder in SEARCHED for path in (ROOT / folder).rglob(name)]
    found += [ROOT / name] if (ROOT / name).is_file() else []
    return found[0] if found else None


def _references(doc: str) -> list[tuple[str, str | None]]:
    return sorted(set(REFERENCE.findall((ROOT / doc).read_text())))


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_doc_names_exists(doc):
    missing = [name for name, _ in _references(doc) if _resolve(name) is None]
    assert not missing, f"{doc} names files that are not there: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_symbol_the_doc_names_is_in_its_file(doc):
    missing = []
    for name, symbol in _references(doc):
        path = _resolve(name)
        if symbol and path is not None and path.suffix == ".py":
            text = path.read_text()
            if not all(re.search(rf"\b{re.escape(part)}\b", text) for part in symbol.split(".")):
                missing.append(f"{name}:{symbol}")
    assert not missing, f"{doc} names symbols its files do not hold: {missing}"
