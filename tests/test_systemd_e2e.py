"""dsv4@.service under a real systemd 252 (booted in a container by the test rig).

The repo is bound read-only at its own path, so the unit runs this checkout's daemon from
the project's virtual environment; the servers are stand-ins on simulated GPUs and the
router is the real sglang-router.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.systemd, pytest.mark.slow]

from box import box, ours, stand_ins  # noqa: F401  (box is a fixture)
from support import wait_for


def test_start_blocks_until_all_three_are_ready_then_stop_is_ordered_and_complete(box):
    box.install(startup=1.5)
    began = time.monotonic()
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    assert time.monotonic() - began >= 1.5
    assert box.is_active("dsv4@pd-1p1d") == "active"
    status = box.systemctl("status", "dsv4@pd-1p1d", check=False).stdout
    assert "Status: \"ready: 2 servers behind router on 0.0.0.0:30001, GPUs 0-7\"" in status
    scopes = box.systemctl("list-units", "--no-legend", "--plain", "dsv4-*").stdout
    for role in ("prefill", "decode", "router"):
        assert f"dsv4-pd-1p1d-{role}.scope" in scopes
    router_lines = box.journal("dsv4@pd-1p1d", "GPUSUP_PROCESS=router", "-o", "json")
    records = [json.loads(line) for line in router_lines.splitlines() if line.strip()]
    assert records and all(r["GPUSUP_PROCESS"] == "router" for r in records)
    assert any(r.get("_SYSTEMD_UNIT") == "dsv4@pd-1p1d.service" for r in records)

    box.systemctl("stop", "dsv4@pd-1p1d", timeout=120)
    stops = box.journal("dsv4@pd-1p1d", "GPUSUP_EVENT=stopped", "-o", "json")
    order = [json.loads(l)["GPUSUP_PROCESS"] for l in stops.splitlines() if l.strip()]
    assert order == ["router", "decode", "prefill"]
    assert ours(box) == [] and stand_ins(box) == []


def test_a_server_that_never_becomes_ready_fails_the_start_and_leaves_nothing(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    profile = box.read_file("/etc/supervisord-gpu/profiles/tp4-512k.toml").replace(
        "start_timeout = 900", "start_timeout = 3").replace(
        "[servers.server.options]", '[servers.server.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "never-ready"\n[servers.server.options]')
    box.write_file("/etc/supervisord-gpu/profiles/tp4-512k.toml", profile)
    r = box.systemctl("start", "dsv4@tp4-512k", check=False, timeout=60)
    assert r.returncode != 0
    assert box.is_active("dsv4@tp4-512k") == "failed"
    journal = box.journal("dsv4@tp4-512k")
    assert "server: not ready within its start_timeout of 3 s" in journal
    assert ours(box) == [] and stand_ins(box) == []


def test_a_start_longer_than_TimeoutStartSec_succeeds_while_it_makes_progress(box):
    box.install(startup=8.0, unit_extra="TimeoutStartSec=4\n")
    box.systemctl("start", "dsv4@tp4-512k", timeout=60)
    assert box.is_active("dsv4@tp4-512k") == "active"
    box.systemctl("stop", "dsv4@tp4-512k", timeout=60)


def test_kill_9_of_the_daemon_leaves_no_child_running(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    assert len(stand_ins(box)) >= 3
    box.systemctl("kill", "-s", "KILL", "--kill-whom=main", "dsv4@pd-1p1d")
    deadline = time.monotonic() + 20
    while (stand_ins(box) or ours(box)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stand_ins(box) == [] and ours(box) == []


def test_a_daemon_that_stops_answering_the_watchdog_is_restarted_and_its_children_do_not_survive(box):
    box.install(startup=0.5, unit_extra="WatchdogSec=2\nRestartSec=1\nTimeoutStopSec=5\n")
    box.systemctl("start", "dsv4@tp4-512k", timeout=120)
    old = {p.pid for p in stand_ins(box)}
    main_pid = box.systemctl("show", "-P", "MainPID", "dsv4@tp4-512k").stdout.strip()
    box.systemctl("kill", "-s", "STOP", "--kill-whom=main", "dsv4@tp4-512k")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new_main = box.systemctl("show", "-P", "MainPID", "dsv4@tp4-512k").stdout.strip()
        if new_main not in ("0", main_pid) and box.is_active("dsv4@tp4-512k") == "active":
            break
        time.sleep(0.5)
    assert box.is_active("dsv4@tp4-512k") == "active" and new_main != main_pid
    assert "watchdog timeout" in box.journal("dsv4@tp4-512k").lower()
    assert not old & {p.pid for p in stand_ins(box)}
    box.systemctl("stop", "dsv4@tp4-512k", timeout=60)


@pytest.mark.parametrize("why, status, retried", [
    ("bad-profile", "2", False),  # a retry fails the same way
    ("port-held", "3", False),  # refused, nothing touched: the operator frees it and starts again
    ("never-ready", "1", True),  # a plain start failure is still retried (Restart=on-failure)
])
def test_restart_on_failure_skips_what_a_retry_cannot_fix(box, why, status, retried):
    box.install(startup=0.5, unit_extra="RestartSec=1\n")
    path = "/etc/supervisord-gpu/profiles/tp4-512k.toml"
    profile = box.read_file(path).replace("start_timeout = 900", "start_timeout = 2")
    if why == "bad-profile":
        profile = profile.replace("tp-size = 4", "tp-size = 4\ncuda-graph-max-bs = 8")
    elif why == "never-ready":
        profile = profile.replace("[servers.server.options]",
                                  '[servers.server.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "never-ready"\n[servers.server.options]')
    else:
        box.run(["systemd-run", "--unit=squatter", "--collect", "python3", "-c",
                 "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                 "s.bind(('0.0.0.0', 30001)); s.listen(); time.sleep(3600)"])
    box.write_file(path, profile)
    assert box.systemctl("start", "dsv4@tp4-512k", check=False, timeout=60).returncode != 0
    assert box.systemctl("show", "-P", "ExecMainStatus", "dsv4@tp4-512k").stdout.strip() == status
    time.sleep(2.5)  # past RestartSec=1
    restarts = int(box.systemctl("show", "-P", "NRestarts", "dsv4@tp4-512k").stdout.strip())
    assert (restarts > 0) == retried, f"NRestarts={restarts}"
    box.systemctl("stop", "dsv4@tp4-512k", check=False)
    assert ours(box) == [] and stand_ins(box) == []


# --------------------------------------------------------------------------- SGLang's own dynamics


def test_a_load_printing_only_carriage_returns_passes_a_start_window_a_third_its_length(box):
    """SGLang's long phases are tqdm bars (`\\r` updates, no `\\n` for minutes): any output is progress."""
    box.install(startup=12.0, stall=3.0, unit_extra="TimeoutStartSec=4\nRestart=no\n")
    began = time.monotonic()
    box.systemctl("start", "dsv4@tp4-512k", timeout=90)
    assert time.monotonic() - began >= 12.0
    assert box.is_active("dsv4@tp4-512k") == "active"
    box.systemctl("stop", "dsv4@tp4-512k", timeout=60)


def test_a_silent_hang_fails_at_the_daemons_deadline_and_systemds_window_never_ends_it_first(box):
    """systemd's window is the engine's deadline (start_timeout while quiet), not TimeoutStartSec:
    the start fails by the daemon's own verdict, which names the limit, and systemd's timeout
    never fires before it."""
    box.install(startup=1.0, stall=3.0, unit_extra="TimeoutStartSec=4\nRestart=no\n")
    path = "/etc/supervisord-gpu/profiles/tp4-512k.toml"
    box.write_file(path, box.read_file(path).replace("start_timeout = 900", "start_timeout = 9").replace(
        "[servers.server.options]", '[servers.server.env]\nSUPERVISORD_GPU_STANDIN_SILENT_S = "120"\n[servers.server.options]'))
    began = time.monotonic()
    assert box.systemctl("start", "dsv4@tp4-512k", check=False, timeout=90).returncode != 0
    took = time.monotonic() - began
    assert 9 <= took < 9 + 5 + 10, took  # start_timeout, the window's margin, slack; TimeoutStartSec=4 did not end it
    journal = box.journal("dsv4@tp4-512k")
    assert "server: not ready within its start_timeout of 9 s" in journal, journal[-3000:]
    assert "start operation timed out" not in journal.lower(), journal[-3000:]
    assert box.systemctl("show", "-P", "ExecMainStatus", "dsv4@tp4-512k").stdout.strip() == "1"
    assert ours(box) == [] and stand_ins(box) == []


def test_a_stranger_taking_the_port_while_the_server_loads_fails_the_start_and_ready_is_never_sent(box):
    box.install(startup=4.0, unit_extra="Restart=no\n")
    box.systemctl("start", "--no-block", "dsv4@tp4-512k")
    wait_for(lambda: "loading weights" in box.systemctl("show", "-P", "StatusText", "dsv4@tp4-512k").stdout, 30,
             "the server to be loading")
    box.run(["systemd-run", "--unit=squatter", "--collect", "-p", "User=nobody", "python3", "-c",
             "import http.server as h\nclass H(h.BaseHTTPRequestHandler):\n def do_GET(s):\n  s.send_response(200); s.end_headers()\n"
             "h.HTTPServer(('127.0.0.1', 30300), H).serve_forever()"])
    states = []
    wait_for(lambda: states.append(box.is_active("dsv4@tp4-512k")) or states[-1] in ("failed", "inactive"), 90,
             "the start to fail")
    assert "active" not in states
    status = box.systemctl("show", "-P", "StatusText", "dsv4@tp4-512k").stdout
    assert "port 127.0.0.1:30300 (server) held by pid" in status and "(user nobody)" in status \
        and "squatter.service" in status and "taken while tp4-512k was starting" in status, (
        status + box.journal("dsv4@tp4-512k")[-4000:])
    journal = box.journal("dsv4@tp4-512k")
    assert "instance ready" not in journal and "Started supervisord-gpu instance" not in journal
    assert box.systemctl("show", "-P", "ExecMainStatus", "dsv4@tp4-512k").stdout.strip() == "3"  # refused: not retried
    box.systemctl("stop", "squatter", check=False)
    assert ours(box) == [] and stand_ins(box) == []


def test_a_server_that_kills_its_process_group_is_restarted_its_errors_are_errors_and_the_daemon_lives(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    path = "/etc/supervisord-gpu/profiles/tp4-512k.toml"
    box.write_file(path, box.read_file(path).replace("max_restarts = 5", "max_restarts = 1").replace(
        "[servers.server.options]", '[servers.server.env]\nSGLANG_KILLPG_ON_SCHEDULER_EXCEPTION = "1"\n'
        'SUPERVISORD_GPU_STANDIN_FAULT = "crash-after-ready:6"\n[servers.server.options]'))  # after the router is up, however loaded
    started = box.systemctl("start", "dsv4@tp4-512k", timeout=90, check=False)
    assert started.returncode == 0, box.journal("dsv4@tp4-512k")[-4000:]
    daemon = box.systemctl("show", "-P", "MainPID", "dsv4@tp4-512k").stdout.strip()
    wait_for(lambda: "restart 1/1" in box.journal("dsv4@tp4-512k"), 30, "the first restart")
    assert box.systemctl("show", "-P", "MainPID", "dsv4@tp4-512k").stdout.strip() == daemon  # the group kill missed it
    wait_for(lambda: box.is_active("dsv4@tp4-512k") == "failed", 60, "the restart limit")
    assert box.systemctl("show", "-P", "ExecMainStatus", "dsv4@tp4-512k").stdout.strip() == "6"  # its own verdict: gave up
    errors = box.journal("dsv4@tp4-512k", "-p", "err", "GPUSUP_PROCESS=server")
    assert "Scheduler hit an exception" in errors, errors  # SGLang prints no level name: classified by what it says
    assert "crashed: SGLang killed itself after a scheduler failed" in box.journal("dsv4@tp4-512k")
    router = box.journal("dsv4@tp4-512k", "GPUSUP_PROCESS=router", "-o", "json")
    assert router and "\\u001b" not in router and "\x1b" not in router  # the router's colour codes are gone
    assert ours(box) == [] and stand_ins(box) == []
