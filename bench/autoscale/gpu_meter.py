"""Each GPU's memory and utilization, as NVML reports them (through ``nvidia-smi``, which every
NVIDIA driver ships: no Python binding to install on a bare GPU machine)."""

from __future__ import annotations

import subprocess
from typing import Any

QUERY = "index,memory.used,memory.total,utilization.gpu"


def gpu_readings() -> list[dict[str, Any]]:
    """One reading per GPU: ``index``, ``memory_used_gib``, ``memory_total_gib`` and
    ``utilization_percent`` (the share of the last sample period a kernel ran); none on a
    machine without an NVIDIA driver."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    readings = []
    for line in out.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            index, used_mib, total_mib, busy = (int(fields[0]), float(fields[1]),
                                                float(fields[2]), float(fields[3]))
        except ValueError:  # "[N/A]" on a GPU that does not report one of them
            continue
        readings.append({"index": index, "memory_used_gib": round(used_mib / 1024, 2),
                         "memory_total_gib": round(total_mib / 1024, 2),
                         "utilization_percent": busy})
    return readings
