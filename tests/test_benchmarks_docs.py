"""docs/benchmarks/ holds what its README says: the current result of each benchmark at the top,
at a fixed name in the README's first table, the older in history/ as its index lists them."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks"
NAMED_FILE = re.compile(r"`((?:docs/benchmarks/)?(?:history/)?[A-Za-z0-9_.-]+\.(?:json|png|log))`")


def current_table() -> list[dict[str, str]]:
    """The rows of the first table of docs/benchmarks/README.md."""
    lines = (BENCHMARKS / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("| "))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        rows.append(dict(zip(header, cells)))
    return rows


def test_benchmarks_hold_the_current_results_at_fixed_names():
    top = {path.name for path in BENCHMARKS.glob("*.json")}
    # The current result of each benchmark; older runs, explorations and A/B pairs in history/.
    assert len(top) <= 15, f"{len(top)} JSON files in docs/benchmarks/: move the older to history/"
    rows = current_table()
    assert [*rows[0]] == ["what", "command", "commit", "GPU", "file"]
    in_table = {re.match(r"`([^`]+)`", row["file"]).group(1) for row in rows}
    assert in_table == top, "the README's first table lists exactly the JSONs at the top"
    for name in top:
        json.loads((BENCHMARKS / name).read_text(encoding="utf-8"))


def test_every_benchmark_file_the_docs_name_exists():
    text = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    missing = [name for name in NAMED_FILE.findall(text)
               if not (BENCHMARKS / name.removeprefix("docs/benchmarks/")).is_file()]
    assert not missing, f"docs/benchmarks/README.md names files that are not there: {missing}"
    index = (BENCHMARKS / "history" / "README.md").read_text(encoding="utf-8")
    listed = {name for name in re.findall(r"^\| `([^`]+)`", index, re.M)}
    listed |= {name.rsplit(".", 1)[0] + ".png" for name in listed
               if f"`{name}` (+ `.png`)" in index}
    on_disk = {path.name for path in (BENCHMARKS / "history").iterdir() if path.name != "README.md"}
    assert on_disk == listed, (f"history/README.md lists {sorted(listed - on_disk)} that are not "
                               f"there and misses {sorted(on_disk - listed)}")
