"""sd_notify: READY=1 only when every process is ready, a human STATUS=, and keep-alives.

EXTEND_TIMEOUT_USEC follows the engine's own start deadline (engine/deadline.py): the window
closes when the loading process's deadline passes (start_timeout with no progress, each
progress moving it to start_stall_timeout after it, start_timeout_max at most), so systemd
never ends a start the engine would still allow, and a server stuck in one phase with nothing
to say lets systemd's TimeoutStartSec fire, as it should. WATCHDOG=1 comes from the event loop itself,
so a wedged loop stops feeding it.
"""

from __future__ import annotations

import array
import asyncio
import os
import re
import select
import socket
import time
from collections.abc import Callable

from ..engine.events import Event
from ..engine.instance import Instance, InstanceStatus
from ..engine.process import START_STALL_S
from ..config.model import gpu_ranges
from ..engine.states import State

_PERCENT = re.compile(r"(\d{1,3})%")  # a tqdm bar's percentage
EXTEND_MARGIN_S = 5.0  # beyond the stall limit, so one late tick cannot fail a healthy start
STALL_S = START_STALL_S  # no progress for this long: stop extending


def status_text(st: InstanceStatus) -> str:
    """The STATUS= line, also shown by `gpusupctl status`."""
    if st.transition:
        return f"{st.state}: {st.transition}"
    if st.state == State.STARTING.value:
        if st.reason:
            return f"starting: {st.reason}"
        parts = []
        for p in st.processes:
            if p.state == State.READY.value:
                parts.append(f"{p.name} ready")
            elif p.state in (State.STARTING.value, State.RESTARTING.value) and p.pid:
                done = _PERCENT.search(p.progress)
                parts.append(f"{p.name} {p.phase or 'starting'} {int(p.phase_elapsed_s)} s"
                             + (f" ({done.group(1)}%)" if done else ""))
            else:
                parts.append(f"{p.name} waiting")
        return "starting: " + "; ".join(parts)
    if st.state == State.READY.value:
        fronts = [p for p in st.processes if p.role == "router"] or st.processes
        gpus = sorted(g for p in st.processes for g in p.gpus)
        servers = [p for p in st.processes if p.role != "router"]
        where = ", ".join(f"{p.host}:{p.port}" for p in fronts)
        noun = "server" if len(servers) == 1 else "servers"
        via = " behind router" if any(p.role == "router" for p in st.processes) else ""
        return f"ready: {len(servers)} {noun}{via} on {where}, GPUs {gpu_ranges(gpus)}"
    if st.state == State.FAILED.value and st.reason.startswith("refusing"):
        return st.reason
    return f"{st.state}: {st.reason}" if st.reason else st.state


class Notifier:
    """Speaks the sd_notify protocol for one instance; a no-op without NOTIFY_SOCKET."""

    def __init__(self, send: Callable[[str], None] | None = None, stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET")) or send is not None
        self._send_fn = send
        self._sd = None
        if send is None and self.enabled:
            import sdnotify

            self._sd = sdnotify.SystemdNotifier()
        self.last_progress = time.monotonic()
        self.last_status = ""
        self.ready_sent = False
        watchdog = os.environ.get("WATCHDOG_USEC")
        self.watchdog_s = int(watchdog) / 1e6 if watchdog and watchdog.isdigit() else None

    def send(self, message: str) -> None:
        if not self.enabled:
            return
        if self._send_fn is not None:
            self._send_fn(message)
        elif self._sd is not None and self._sd.socket is not None:
            # Not sdnotify's notify(): it encodes Latin-1 and silently drops anything else, so a
            # STATUS= naming a holder's command line ("python3 -c …") never reached systemd.
            try:
                self._sd.socket.sendall(message.encode("utf-8", "replace"))
            except OSError:
                pass

    def barrier(self, timeout: float = 5.0) -> bool:
        """Wait until systemd has processed everything sent so far (BARRIER=1, systemd >= 246).

        Needed before exiting: systemd attributes a notification to a unit by its sender's
        PID, and a daemon that sends its last STATUS= ("failed: prefill: exited during
        start-up") and exits at once races its own exit — the message is dropped and
        `systemctl status` goes on showing "starting: ...". True once systemd has caught up.
        """
        if not self.enabled or self._send_fn is not None:
            return False
        return notify_barrier(os.environ.get("NOTIFY_SOCKET", ""), timeout)

    def status(self, text: str) -> None:
        if text != self.last_status:
            self.last_status = text
            self.send(f"STATUS={text}")

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def attach(self, instance: Instance) -> None:
        def on_event(event: Event) -> None:
            if event.kind in ("phase", "process", "instance"):
                self.progress()
            self.status(status_text(instance.status()))
            if event.kind == "instance" and event.state == State.READY.value and not self.ready_sent:
                self.ready_sent = True
                self.send("READY=1")
            if event.kind == "instance" and event.state == State.STOPPING.value:
                self.send("STOPPING=1")

        instance.listeners.append(on_event)

    async def run(self, instance: Instance, healthy: Callable[[], bool]) -> None:
        """The keep-alive loop: STATUS refresh, EXTEND_TIMEOUT_USEC while progressing, WATCHDOG=1."""
        period = 1.0
        if self.watchdog_s:
            period = min(period, self.watchdog_s / 3)
        while True:
            lines = [p.last_output_at for p in instance.processes.values() if p.last_output_at]
            if lines:
                self.last_progress = max(self.last_progress, max(lines))
            st = instance.status()
            self.status(status_text(st))
            if st.state == State.STARTING.value:
                window = self.start_window(instance)
                if window > 0:
                    self.send(f"EXTEND_TIMEOUT_USEC={int(window * 1e6)}")
            if self.watchdog_s and healthy():
                self.send("WATCHDOG=1")
            await asyncio.sleep(period)


    def start_window(self, instance: Instance) -> float:
        """Seconds systemd should wait from now: a window, not a grant. While a process waits
        for readiness, until its deadline (plus a margin for the next tick); between processes,
        stall_s after the last progress. A start that goes quiet fails within that, not later."""
        now = time.monotonic()
        deadlines = [d for d in (p.deadline_at() for p in instance.processes.values()) if d is not None]
        if deadlines:
            return max(deadlines) - now + EXTEND_MARGIN_S
        quiet = now - self.last_progress
        return self.stall_s - quiet + EXTEND_MARGIN_S if quiet < self.stall_s else 0.0


def notify_barrier(address: str, timeout: float) -> bool:
    """sd_notify_barrier(3): send BARRIER=1 with a pipe's write end; systemd closes its copy
    after processing every earlier message, and we see the hang-up."""
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendmsg([b"BARRIER=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]))], 0, address)
        os.close(w)
        w = -1
        poller = select.poll()
        poller.register(r, select.POLLHUP)
        return bool(poller.poll(int(timeout * 1000)))
    except OSError:
        return False
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
