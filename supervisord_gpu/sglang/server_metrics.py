"""What SGLang 0.5.23 tells about its own work: its /metrics counters and its process titles.

Who writes them: the server's own processes, i.e. the model code it runs, and whoever holds
its port while it is down (the port check names strangers; see engine/process.py). So the
text is foreign input: it is parsed here into a typed record, and a body that does not parse
(not text, too long, a wanted sample that is not a finite number >= 0) is one line saying
what is wrong and counts as no evidence at all: never a crash, never a kill by itself
(engine/hang.py only ever kills on the processes' own state and CPU time).

Names (`--enable-metrics`; srt/metrics/collector.py, and the stand-in's /metrics copies them):
the scheduler's gauges `sglang:num_running_reqs` and `sglang:num_queue_reqs` (summed over the
processes that write them), the front end's counters `sglang:generation_tokens_total`,
`sglang:prompt_tokens_total` and `sglang:num_requests_total`, which move when a request's
output reaches the front end, i.e. after the detokenizer.
"""

from __future__ import annotations

import math

from ..records import dataclass

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
GENERATION_TOKENS = "sglang:generation_tokens_total"
PROMPT_TOKENS = "sglang:prompt_tokens_total"
REQUESTS = "sglang:num_requests_total"
WANTED = (RUNNING, QUEUED, GENERATION_TOKENS, PROMPT_TOKENS, REQUESTS)
#: a larger body is not read on (SGLang's, with histograms for a few models, is tens of KiB)
MAX_BODY = 1 << 20
#: every process title SGLang 0.5.23 sets (setproctitle; /proc/PID/comm keeps 15 bytes of it)
SCHEDULER_COMM = "sglang::schedul"  # sglang::scheduler, sglang::scheduler_TP<r>
DETOKENIZER_COMM = "sglang::detoken"  # sglang::detokenizer
DP_CONTROLLER_COMM = "sglang::data_pa"  # sglang::data_parallel_controller


def role_of(comm: str, is_main: bool) -> str:
    """The pipeline stage a process of a server's cgroup is: "front end" (the main process:
    HTTP and the tokenizer), "scheduler", "detokenizer", "dp controller", or "" (any other,
    e.g. a compile worker: not judged)."""
    if is_main:
        return "front end"
    return {SCHEDULER_COMM: "scheduler", DETOKENIZER_COMM: "detokenizer",
            DP_CONTROLLER_COMM: "dp controller"}.get(comm, "")


@dataclass(frozen=True)
class ServerMetrics:
    """The few samples the hang verdict reads, summed over label sets; None where absent."""

    running: float | None = None
    queued: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    requests: float | None = None

    @property
    def in_flight(self) -> float | None:
        if self.running is None and self.queued is None:
            return None
        return (self.running or 0.0) + (self.queued or 0.0)

    @property
    def progress(self) -> tuple[float | None, float | None]:
        """What moves when work is done: tokens out, requests completed."""
        return self.generation_tokens, self.requests


class MetricsError(ValueError):
    """A /metrics body that is no evidence; the message is one line naming what is wrong."""


def parse(body: bytes) -> ServerMetrics:
    """Prometheus text (0.0.4) into a ServerMetrics; MetricsError when it cannot be trusted."""
    if len(body) > MAX_BODY:
        raise MetricsError(f"/metrics body of more than {MAX_BODY} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsError("/metrics body is not UTF-8 text") from None
    sums: dict[str, float] = {}
    for number, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, rest = _split_name(line)
        if name not in WANTED:
            continue
        value_text = rest.split()[0] if rest.split() else ""
        try:
            value = float(value_text)
        except ValueError:
            raise MetricsError(f"/metrics line {number}: {name} has no number ({_shown(value_text)})") from None
        if not math.isfinite(value) or value < 0:
            raise MetricsError(f"/metrics line {number}: {name} = {_shown(value_text)} (not a finite number >= 0)")
        sums[name] = sums.get(name, 0.0) + value
    return ServerMetrics(running=sums.get(RUNNING), queued=sums.get(QUEUED),
                         generation_tokens=sums.get(GENERATION_TOKENS), prompt_tokens=sums.get(PROMPT_TOKENS),
                         requests=sums.get(REQUESTS))


def _split_name(line: str) -> tuple[str, str]:
    """("name", "value [timestamp]") of a sample line; label values may hold spaces, braces and
    escaped quotes, so the closing brace is found outside quotes."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or (0 <= space < brace):
        name, _, rest = line.partition(" ")
        return name, rest
    quoted = escaped = False
    for i in range(brace + 1, len(line)):
        c = line[i]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return line[:brace], line[i + 1:]
    return line[:brace], ""  # no closing brace: no value


def _shown(text: str) -> str:
    """A neighbour's words in our line: printable, short."""
    clean = "".join(c if c.isprintable() else "?" for c in text[:40])
    return repr(clean)
