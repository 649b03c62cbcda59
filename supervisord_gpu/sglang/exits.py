"""What an exit status of an SGLang server (or the router) means, in words an operator can act on.

SGLang's exits do not say what happened by themselves (sglang-server.md):
* a crash ends with SGLang SIGKILLing itself after its scheduler failed (SubprocessWatchdog /
  SIGQUIT path), so "killed by SIGKILL" usually means "crashed", not "someone killed it";
* exit 3 is uvicorn failing to bind the HTTP port (someone else holds it), after the model
  loaded for minutes; the router exits 1 when its HTTP or Prometheus port is taken;
* exit 2 is argparse rejecting the command line;
* SIGTERM during loading (before the lazy handler is installed) ends it by signal 15.
The last error line it printed says the rest.
"""

from __future__ import annotations

import signal

SELF_KILL_MARKERS = ("Received sigquit from a child process", "Scheduler hit an exception", "crashed with exit code")
#: uvicorn's (SGLang exits 3), the router's HTTP port and its Prometheus port (exit 1)
BIND_FAILED_MARKERS = ("error while attempting to bind", "Address already in use",
                       "failed to install Prometheus metrics exporter")
MARKERS = (*SELF_KILL_MARKERS, *BIND_FAILED_MARKERS)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(code: int, saw: tuple[str, ...] = (), sent: dict[int, str] | None = None,
                  port_holder: str = "") -> str:
    """One phrase for `last_exit`, in our own words only: it goes to STATUS= and to every local
    user on the bus, so it never quotes the child (its lines can hold secrets: SGLang logs its
    server_args, api_key included). The child's last error line travels beside it, to the
    journal and to privileged readers (`with_error`).

    `saw`: the markers above that appeared in the process's output; `sent`: the signals we
    sent it and why ({SIGTERM: "stopped by the supervisor"}); `port_holder`: who holds its
    port now (for exit 3). A SIGKILL we did not send, after SGLang said a child failed, is
    SGLang's own crash path even while we were stopping it.
    """
    sent = sent or {}
    if code < 0:
        name = signal_name(code)
        if -code in sent:
            return f"killed by {name} ({sent[-code]})"
        if code == -signal.SIGKILL and any(m in saw for m in SELF_KILL_MARKERS):
            return "crashed: SGLang killed itself after a scheduler failed"
        return f"killed by {name}"
    if code == 0:
        return "exit code 0"
    if any(m in saw for m in BIND_FAILED_MARKERS):
        return f"exit code {code}: its port was taken" + (f": {port_holder}" if port_holder else " by another process")
    if code == 2:
        return "exit code 2: the command line was rejected"
    return f"exit code {code}"


def with_error(phrase: str, last_error: str) -> str:
    """The full account, for the journal and privileged readers: our phrase and the child's words."""
    return f"{phrase}: {last_error}" if last_error else phrase
