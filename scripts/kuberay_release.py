"""What a written RayService pins: the image, the weights' revision, Redis's address, and for a
rollout the running cluster's size (scripts/write_rayservices.py)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from scripts import kuberay_pods as pods

ROOT = Path(__file__).resolve().parents[1]
GPU_LOCK = ROOT / "requirements" / "minicpmo+cpu-voice+quant+gpu.txt"
# GCS fault tolerance: the Redis the head keeps the cluster's state in (docs/operations.md says
# how to run one); its password comes from pods.REDIS_SECRET.
REDIS_ADDRESS = "tts-redis:6379"
# The templates' revision: what is applied (--out) must name the commit instead.
UNPINNED = "UNPINNED"
COMMIT = re.compile(r"^[0-9a-f]{40}$")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Release:
    """What a manifest pins: the image, the weights' revision, where Redis is, and for a
    rollout the running cluster's GPU pods (None: the profile's minimum)."""

    image: str
    revision: str = UNPINNED
    redis_address: str = REDIS_ADDRESS
    log_image: str = pods.LOG_SIDECAR_IMAGE
    gpu_replicas: int | None = None


def locked_version(package: str, lock: Path = GPU_LOCK) -> str:
    """The version ``lock`` pins for ``package`` (``name==version``)."""
    found = re.search(rf"^{re.escape(package)}==([^\s;\\]+)", lock.read_text(), flags=re.M)
    if found is None:
        raise ValueError(f"{lock.name} pins no {package}")
    return found.group(1)


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                     flags=re.M).group(1)


def default_image() -> str:
    return f"minicpmo-serve:{project_version()}"


def release_for(args: argparse.Namespace, applied: bool) -> Release:
    """The release the options name; ValueError where what is applied is not pinned."""
    if applied and not DIGEST.search(args.image or ""):
        raise ValueError(f"--image {args.image!r}: pin what is applied by digest "
                         "(registry/name@sha256:<64 hex>; `docker buildx imagetools inspect` "
                         "or the push's output prints it)")
    if applied and not COMMIT.match(args.model_revision or ""):
        raise ValueError(f"--model-revision {args.model_revision!r}: the checkpoint's commit "
                         "on the Hub, 40 hex digits")
    return Release(args.image or default_image(), args.model_revision or UNPINNED,
                   args.redis_address, args.log_image, args.gpu_replicas)
