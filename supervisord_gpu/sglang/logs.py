"""How to read SGLang's and the router's output: start-up phases, and how bad a line is.

SGLang 0.5.23 prints a line at each start-up step (shared/reference/sglang-server.md); knowing
the phase lets STATUS say "prefill capturing CUDA graphs 41 s" and lets the notifier extend the
start timeout only while start-up is making progress. Its long phases print tqdm bars (updates
separated by `\\r`, one `\\n` at the end): the phase rules apply to those updates too.

SGLang's lines carry no level name (`[2026-12-01 08:00:00 TP0] Scheduler hit an exception: ...`),
so its failures are recognised by what they say; the router's lines carry ANSI colour codes
even into a pipe (`\\x1b[31mERROR\\x1b[0m`), which are removed before anything else looks at a
line (and before it reaches the journal).
"""

from __future__ import annotations

import re

LAUNCHED = "launched"
LOADING_WEIGHTS = "loading weights"
ALLOCATING_KV = "allocating KV cache"
CAPTURING_GRAPHS = "capturing CUDA graphs"
COMPILING = "compiling kernels"
WARMING_UP = "warming up"
SERVING = "serving"
DRAINING = "draining"
INIT_FAILED = "initialization failed"

PHASE_ORDER = (LAUNCHED, LOADING_WEIGHTS, ALLOCATING_KV, CAPTURING_GRAPHS, COMPILING, WARMING_UP, SERVING)

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Load weight begin|Loading safetensors checkpoint shards"), LOADING_WEIGHTS),
    (re.compile(r"Load weight end"), ALLOCATING_KV),
    (re.compile(r"KV Cache is allocated|Memory pool end"), ALLOCATING_KV),
    (re.compile(r"Capture .*CUDA graph begin|Capturing batches"), CAPTURING_GRAPHS),
    (re.compile(r"DeepGEMM|JIT warmup|Compiling|compiling kernels"), COMPILING),
    (re.compile(r"Capture .*CUDA graph end|max_total_num_tokens=|Uvicorn running on"), WARMING_UP),
    (re.compile(r"The server is fired up and ready to roll"), SERVING),
    (re.compile(r"SIGTERM received|starting graceful shutdown"), DRAINING),
    (re.compile(r"Initialization failed"), INIT_FAILED),
)

# One alternation searched once per line: the daemon may forward tens of thousands of lines a second.
_ANY = re.compile("|".join(f"(?:{p.pattern})" for p, _ in _RULES))

# CSI sequences (colours, cursor moves) and the two-byte escapes; what `less -R` would interpret.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

# Errors: level words (the router, uvicorn, Python's logging), and what SGLang's level-less
# failure lines say (sglang-server.md, "Failure lines"), plus tracebacks and Rust panics.
_ERROR = re.compile(
    r"\b(?:ERROR|CRITICAL|FATAL)\b"
    r"|Traceback \(most recent call last\)"
    r"|^(?:\[[^\]]*\]\s*)?[A-Za-z_][\w.]*(?:Error|Exception): "
    r"|Scheduler hit an exception|Received sigquit from a child process|crashed with exit code"
    r"|Initialization failed|Health check failed|watchdog timeout|error while attempting to bind"
    r"|CUDA out of memory|panicked at"
)
_WARNING = re.compile(r"\b(?:WARNING|WARN)\b")


# SGLang's "[2026-12-01 08:00:00 TP0] " and the router's "2026-12-01 08:00:00  INFO target: " prefixes
_STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\]\s*|^\d{4}-\d\d-\d\d[ T][\d:.Z]+\s+")
# error lines that say only that something else failed: never the reason to show
_GENERIC = ("Received sigquit from a child process", "SIGQUIT received", "kill_process_tree called")


def message_of(line: str) -> str:
    """A line without its time stamp: what to quote as a reason."""
    return _STAMP.sub("", line, count=1).strip()


def is_reason(line: str) -> bool:
    """An error line worth quoting as the reason for an exit (not "a child failed" boilerplate)."""
    return not any(g in line for g in _GENERIC)


# uvicorn's access log ('INFO:     127.0.0.1:47052 - "GET /health HTTP/1.1" 503') and the router's
# request spans: the echo of requests (our own probes among them), not a sign of start-up progress
# uvicorn's complaints about what a client sent ("Invalid HTTP request received.") are written by
# whoever connects: a neighbour sending garbage would otherwise extend a hung start for hours
# Any method: uvicorn (httptools and h11 alike) answers and logs TRACE, CONNECT, PROPFIND and
# h11 any token at all ("foo /x"); a list of the usual seven let a neighbour's `TRACE /x` every
# few seconds keep a hung start "making progress" until start_timeout_max (hostile read, #37).
# SGLang's own echoes of a request carry the client's words: "[http_server] Error: Duplicate
# request ID detected: RID" (the rid is the client's: "The server is fired up and ready to roll!"
# would read as a phase), and --log-requests' "Receive: obj=..." / "Finish: obj=...".
_ACCESS = re.compile(r'"[!#$%&\'*+.^_`|~0-9A-Za-z-]+ \S+ HTTP/\d(?:\.\d)?" \d{3}|http_request\{method='
                     r'|Invalid HTTP request received|Unsupported upgrade request|No supported WebSocket library'
                     r'|\[http_server\] |^(?:\[[^\]]*\]\s*)?(?:Receive|Finish): '
                     # the PD KV manager's ZMQ sockets (bound on the host's address before the HTTP
                     # port) log what a neighbour sends them: "Malformed ABORT message: invalid room
                     # field %r", "Dropping malformed bootstrap control message" (conn.py, 0.5.23)
                     r'|[Mm]alformed ')


def is_access_log(line: str) -> bool:
    return _ACCESS.search(line) is not None


# tqdm's bars ("Capturing batches (bs=64): 30%|███ | 3/10 [...]", SGLang's "... 50% Completed | 1/2 [...]",
# a bar without a total: "5it [00:01, 3.20it/s]")
_BAR = re.compile(r"\d%|\d+/\d+ \[|\dit \[|(?:it/s|s/it)\]")

# uvicorn's start line: from here on anyone who reaches the port can make the server print.
_HTTP_OPEN = re.compile(r"Uvicorn running on")


def opens_http(line: str) -> bool:
    """The server's HTTP port is up (SGLang starts uvicorn, then warms up through it)."""
    return _HTTP_OPEN.search(line) is not None


def is_start_progress(line: str, http_open: bool = True) -> bool:
    """Whether a line (or a `\\r` update) moves a start's stall deadline.

    Never the echo of a request (an access line of any method, uvicorn's complaint about garbage,
    SGLang's own `[http_server] ...` and `Receive:`/`Finish:` echoes): anyone who connects makes
    the server print those, and were they progress a stranger would keep a hung start alive up to
    start_timeout_max (#37). Before the HTTP port is up only the server writes, and every other
    line of it counts: a long load prints much that no rule names (NCCL, loaders, warnings), and
    a quiet load killed at its stall bound costs a cold start. Once the port is up, SGLang 0.5.23
    also prints lines for anyone's requests (`GET /get_model_info` a deprecation warning, a bad
    /generate an error, a stuck scheduler "Health check failed", a /generate the batch lines):
    from then on only a phase line or a progress bar counts."""
    if is_access_log(line):
        return False
    if not http_open:
        return True
    return _ANY.search(line) is not None or _BAR.search(line) is not None


def strip_ansi(line: str) -> str:
    """The text without terminal escape sequences (the router colours its lines even in a pipe)."""
    return _ANSI.sub("", line) if "\x1b" in line else line


def phase_of(line: str) -> str | None:
    """The phase a log line (or a progress update) announces, or None for ordinary lines and
    for the access log: its path is the client's (`GET /DeepGEMM` is no compile phase)."""
    if _ANY.search(line) is None or is_access_log(line):
        return None
    for pattern, phase in _RULES:
        if pattern.search(line):
            return phase
    return None


def priority_of(line: str) -> int:
    """syslog priority for a child's (escape-free) line: 3 for errors, 4 for warnings, 6 otherwise."""
    if _ERROR.search(line):
        return 3
    if _WARNING.search(line):
        return 4
    return 6
