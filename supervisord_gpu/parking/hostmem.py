"""How much host memory a park may take: MemAvailable from /proc/meminfo, the kernel's own
estimate of what can be allocated without swapping.

/proc/meminfo is the kernel's (nobody else writes it); still parsed, not trusted to be shaped:
a line that does not parse is a figure we do not have, and a park without the figure is refused
(never guessed)."""

from __future__ import annotations

MEMINFO = "/proc/meminfo"


def parse_mem_available(text: str) -> int | None:
    """Bytes of MemAvailable, or None when the text has no well-formed "MemAvailable: N kB" line."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[1].isdigit():
                return int(parts[1]) * 1024
            return None
    return None


def mem_available(path: str = MEMINFO) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse_mem_available(f.read(65536))
    except OSError:
        return None
