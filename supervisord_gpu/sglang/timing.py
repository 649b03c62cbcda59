"""SGLang 0.5.23's own clocks and numbers, which the supervisor's must respect.

From sglang-server.md (read from SGLang's source): what its health check costs and when it
gives up, how its drain and watchdog behave, which ports it picks by itself. Probes and
validation are written against these, so that the supervisor is never stricter than
SGLang's own verdict on itself.
"""

from __future__ import annotations

#: GET /health (= /health_generate) submits a one-token generation and sleeps 1 s before its
#: first look: it never answers 200 faster than this
HEALTH_MIN_S = 1.0
#: SGLANG_HEALTH_CHECK_TIMEOUT: /health answers 503 (and marks the server UnHealthy) after this
HEALTH_VERDICT_S = 20.0
#: --watchdog-timeout: a forward pass stuck this long makes SGLang kill itself
WATCHDOG_S = 300.0
#: the hang verdict (engine/hang.py): a stage stopped, or a scheduler neither answering nor
#: working, this long is hung. Longer than any pause SGLang makes in its own loop while it
#: answers (a 6 s stall that latches /ready, a /slow_down of a few seconds per step) and than a
#: debugger's short stop; short enough that window + 2 looks + the 5 s stack dump stay within
#: 30 s (15 + 2 x 2 + 5 = 24 s, with 6 s to spare for a loaded machine)
HANG_WINDOW_S = 15.0
#: how often the hang verdict looks (/proc of its processes, one /metrics, NVML): cheap
HANG_INTERVAL_S = 2.0
#: after SIGTERM, SGLang looks for "no requests left" this often, with no upper bound
DRAIN_POLL_S = 5.0
#: then it waits this long for its schedulers before killing them
SCHEDULER_EXIT_WAIT_S = 15.0

#: paths that run a generation (the deep check): fine for readiness, too costly for liveness
DEEP_HEALTH_PATHS = ("/health", "/health_generate")
#: the cheap status check, answered by the HTTP front end alone: 200 iff up, not paused, not
#: draining and not latched UnHealthy by a failed /health; a 503 there is not death
CHEAP_STATUS_PATH = "/ready"
#: a request the scheduler answers itself (get_internal_state), also while generation is paused
SCHEDULER_ROUND_TRIP_PATH = "/server_info"

#: with no --nccl-port, every server picks its NCCL port at random in this range
#: (get_free_port_below_ephemeral: 22000-29999, capped below the ephemeral range): a port a
#: profile gives to another process there can be taken by a server started before it
NCCL_RANDOM_PORTS = range(22000, 30000)
#: with --enable-dp-attention (one node) a server also binds --port plus these: the DP
#: controller's handshake (+13), torch's dist-init port (+233) and five ZMQ channels (+234..+239)
DP_ATTENTION_PORT_OFFSETS = (13, *range(233, 240))


def watchdog_s(options: tuple[tuple[str, object], ...]) -> float:
    """The server's --watchdog-timeout: a profile's positive number, else SGLang's default."""
    given = dict(options).get("watchdog-timeout")
    if isinstance(given, (int, float)) and not isinstance(given, bool) and given > 0:
        return float(given)
    return WATCHDOG_S
