"""Print the hash of what pyproject.toml declares about dependencies (build-system requires,
requires-python, dependencies, optional-dependencies). scripts/lock writes it into every lock in
requirements/; scripts/setup refuses a lock whose hash differs (pyproject.toml changed since)."""

import hashlib
import json
import sys
import tomllib


def deps_hash(path: str = "pyproject.toml") -> str:
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    project = data["project"]
    declared = {
        "build-system": data.get("build-system", {}).get("requires", []),
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
    }
    return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()[:16]


if __name__ == "__main__":
    print(deps_hash(*sys.argv[1:]))
