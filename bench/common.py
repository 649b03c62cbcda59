"""Shared by the benchmarks: medians and ratios over repeated runs, JSON results with the machine named."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # support, box, the rig


def machine() -> dict[str, object]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def write(name: str, data: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, default=str) + "\n")
    return path


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def terminate(proc: subprocess.Popen, timeout: float = 30) -> None:  # type: ignore[type-arg]
    """SIGTERM a supervisor we started (ours, or the one we compare against), SIGKILL past `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_holders(sim) -> int:  # type: ignore[no-untyped-def]
    """Kill what still holds memory on SimulatedGpus `sim` (what a teardown left behind); returns how many."""
    holders = sim.holders()
    for h in holders:
        try:
            os.kill(h.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while sim.holders() and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(holders)


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the (start, end) spans was open: processes of one
    stop wave die side by side, and summing their dying times would count that time N times."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
