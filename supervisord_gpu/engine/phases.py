"""Start-up phases of an SGLang server, read from its log lines.

SGLang 0.5.23 prints a line at each step (shared/reference/sglang-server.md); knowing the
phase lets STATUS say "prefill capturing CUDA graphs 41 s" and lets the notifier extend the
start timeout only while start-up is making progress.
"""

from __future__ import annotations

import re

LAUNCHED = "launched"
LOADING_WEIGHTS = "loading weights"
ALLOCATING_KV = "allocating KV cache"
CAPTURING_GRAPHS = "capturing CUDA graphs"
WARMING_UP = "warming up"
SERVING = "serving"
DRAINING = "draining"
INIT_FAILED = "initialization failed"

PHASE_ORDER = (LAUNCHED, LOADING_WEIGHTS, ALLOCATING_KV, CAPTURING_GRAPHS, WARMING_UP, SERVING)

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Load weight begin"), LOADING_WEIGHTS),
    (re.compile(r"Load weight end"), ALLOCATING_KV),
    (re.compile(r"KV Cache is allocated|Memory pool end"), ALLOCATING_KV),
    (re.compile(r"Capture .*CUDA graph begin"), CAPTURING_GRAPHS),
    (re.compile(r"Capture .*CUDA graph end|max_total_num_tokens="), WARMING_UP),
    (re.compile(r"The server is fired up and ready to roll"), SERVING),
    (re.compile(r"SIGTERM received|starting graceful shutdown"), DRAINING),
    (re.compile(r"Initialization failed"), INIT_FAILED),
)

_ERROR = re.compile(r"\b(ERROR|CRITICAL|FATAL|Traceback|Exception|Error:)\b")
_WARNING = re.compile(r"\b(WARNING|WARN)\b")


# One alternation searched once per line: the daemon may forward tens of thousands of lines a second.
_ANY = re.compile("|".join(f"(?:{p.pattern})" for p, _ in _RULES))


def phase_of(line: str) -> str | None:
    """The phase a log line announces, or None for the ordinary lines (most of them)."""
    if _ANY.search(line) is None:
        return None
    for pattern, phase in _RULES:
        if pattern.search(line):
            return phase
    return None


def priority_of(line: str) -> int:
    """syslog priority for a child's line: 3 for errors, 4 for warnings, 6 otherwise."""
    if _ERROR.search(line):
        return 3
    if _WARNING.search(line):
        return 4
    return 6
