"""Helpers the benchmark scripts share: the machine and checkout they ran on, page-cache control
and the process's disk counter (the engine's cpu_model and evict are reused, not rewritten)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from flashmoe.engine.benchmark import cpu_model, disk_read_bytes, evict  # noqa: F401  (re-exported for the scripts)

ROOT = Path(__file__).resolve().parent.parent


def mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def source_revision() -> str:
    """The checkout's commit, and whether engine/ differs from it (the engine is what we time)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "engine"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (engine/ has uncommitted changes)" if dirty else " (engine/ clean)")


def read_into_page_cache(files) -> None:
    buf = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
