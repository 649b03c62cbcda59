"""What an exit status of an SGLang server (or the router) means, in words an operator can act on.

SGLang's exits do not say what happened by themselves (sglang-server.md):
* a crash ends with SGLang SIGKILLing itself after its scheduler failed (SubprocessWatchdog /
  SIGQUIT path), so "killed by SIGKILL" usually means "crashed", not "someone killed it";
* exit 3 is uvicorn failing to bind the HTTP port (someone else holds it), after the model
  loaded for minutes; the router exits 1 when its HTTP or Prometheus port is taken;
* exit 2 is argparse rejecting the command line;
* SIGTERM during loading (before the lazy handler is installed) ends it by signal 15;
* once serving, its SIGQUIT handler ("SIGQUIT received. ... It usually means one child failed.",
  tokenizer_manager.py:4072) replaces the launch-phase one ("Received sigquit from a child
  process"): a child's failure, the scheduler's watchdog on a stuck forward pass ("Scheduler
  watchdog timeout (...)", utils/watchdog.py:154, after --watchdog-timeout), or anyone's
  `kill -QUIT` all end in the same self-SIGKILL.
The last error line it printed says the rest.
"""

from __future__ import annotations

import signal

#: SGLang's scheduler watchdog found a forward pass stuck past --watchdog-timeout
WATCHDOG_MARKERS = ("Scheduler watchdog timeout",)
#: the main process's SIGQUIT handlers: launch phase, then running phase
SIGQUIT_MARKERS = ("Received sigquit from a child process", "SIGQUIT received")
#: a child failed (scheduler exception, or the subprocess watchdog found one dead)
CHILD_FAILED_MARKERS = ("Scheduler hit an exception", "crashed with exit code")
SELF_KILL_MARKERS = (*WATCHDOG_MARKERS, *SIGQUIT_MARKERS, *CHILD_FAILED_MARKERS)
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
        if code == -signal.SIGKILL:
            crash = _self_kill(saw)
            if crash:
                return crash
        return f"killed by {name}"
    if code == 0:
        return "exit code 0"
    if any(m in saw for m in BIND_FAILED_MARKERS):
        return f"exit code {code}: its port was taken" + (f": {port_holder}" if port_holder else " by another process")
    if code == 2:
        return "exit code 2: the command line was rejected"
    return f"exit code {code}"


def _self_kill(saw: tuple[str, ...]) -> str:
    """Which of SGLang's own SIGKILL paths `saw` shows, most specific first ("" for none)."""
    if any(m in saw for m in WATCHDOG_MARKERS):
        return "crashed: SGLang's watchdog found a forward pass stuck, and SGLang killed itself"
    if any(m in saw for m in CHILD_FAILED_MARKERS) or "Received sigquit from a child process" in saw:
        return "crashed: SGLang killed itself after a scheduler failed"
    if "SIGQUIT received" in saw:
        return "crashed: SGLang got SIGQUIT and killed itself"
    return ""


def with_error(phrase: str, last_error: str) -> str:
    """The full account, for the journal and privileged readers: our phrase and the child's words."""
    return f"{phrase}: {last_error}" if last_error else phrase
