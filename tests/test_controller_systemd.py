"""The controller's verbs under a real systemd: what each one waits for, and that it says why.

Each test is one promise of issue 17 to an operator, checked from the outside (systemctl,
gpusupctl, the journal) against a real systemd in a container; the servers are stand-ins.
"""

from __future__ import annotations

import json
import time

import pytest

from box import REPO, box, ours, server_profile as profile  # noqa: F401  (box is a fixture)
from support import wait_for

pytestmark = pytest.mark.systemd
CTL = f"{REPO}/.venv/bin/gpusupctl"


def show(box, unit: str, *props: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    out = box.systemctl("show", *(f"--property={p}" for p in props), unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_restart_wait_returns_once_the_new_daemon_is_ready(box):
    box.install(startup=3.0)
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001))
    box.systemctl("start", "dsv4@alpha", timeout=60)
    old = show(box, "dsv4@alpha.service", "MainPID")["MainPID"]
    began = time.monotonic()
    r = box.run([CTL, "restart", "alpha", "--wait"], timeout=120)
    took = time.monotonic() - began
    now = show(box, "dsv4@alpha.service", "ActiveState", "MainPID", "StatusText")
    assert r.stdout.strip().splitlines()[-1] == "dsv4@alpha.service: active", r.stdout
    assert now["ActiveState"] == "active" and now["MainPID"] != old, now
    assert now["StatusText"].startswith("ready: 1 server on 127.0.0.1:31001"), now  # the new daemon's READY
    assert "starting:" in r.stdout and took > 3.0, (took, r.stdout)  # it waited through the 3 s load


def test_a_restart_limit_reached_is_final_and_systemd_does_not_retry_it(box):
    box.install(startup=0.5)  # the shipped unit: Restart=on-failure, RestartSec=10
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(
        0, 31001, fault="crash-after-ready:1", extra="[restart]\nmax_restarts = 1\nbackoff_initial = 0.1\n"))
    box.systemctl("start", "dsv4@alpha", timeout=60)
    wait_for(lambda: box.is_active("dsv4@alpha") == "failed", 60, "the instance to give up")
    gone = show(box, "dsv4@alpha.service", "ExecMainStatus", "NRestarts", "StatusText")
    assert gone["ExecMainStatus"] == "6" and gone["NRestarts"] == "0", gone
    assert gone["StatusText"].startswith("failed: server ") and "restart limit reached" in gone["StatusText"], gone
    time.sleep(12)  # past RestartSec: nothing comes back with a fresh budget
    again = show(box, "dsv4@alpha.service", "ActiveState", "NRestarts")
    assert again == {"ActiveState": "failed", "NRestarts": "0"}, again
    assert ours(box) == []


def test_status_shows_the_sub_state_and_never_a_dead_daemons_line_as_current(box):
    box.install(startup=0.5)  # Restart=on-failure, RestartSec=10: a crashed daemon waits in auto-restart
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001))
    box.systemctl("start", "dsv4@alpha", timeout=60)
    box.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", "dsv4@alpha")
    wait_for(lambda: show(box, "dsv4@alpha.service", "SubState")["SubState"] == "auto-restart", 30, "auto-restart")
    out = box.run([CTL, "status", "alpha"]).stdout
    head = next(line for line in out.splitlines() if line.startswith("dsv4@alpha.service"))
    assert "(auto-restart)" in head, out
    assert "last status (daemon gone): ready:" in out and "\n  ready:" not in out, out
    data = json.loads(box.run([CTL, "status", "alpha", "--json"]).stdout)["instances"][0]
    assert data["sub_state"] == "auto-restart" and data["status_text"] == "" and data["last_status_text"].startswith("ready:")
    box.systemctl("stop", "dsv4@alpha", timeout=60)


def test_status_text_carries_the_reason_for_a_config_error_and_a_foreign_holder(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    box.write_file("/etc/supervisord-gpu/profiles/bad.toml", profile(0, 31001) + "\nnot_a_key = 1\n")
    assert box.systemctl("start", "dsv4@bad", check=False, timeout=60).returncode != 0
    text = show(box, "dsv4@bad.service", "StatusText", "ExecMainStatus")
    assert text == {"ExecMainStatus": "2", "StatusText":
                    "failed: /etc/supervisord-gpu/profiles/bad.toml: servers.server.not_a_key: unknown key"}, text
    box.run(["systemd-run", "--unit=squatter", "--collect", "python3", "-c",
             "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.bind(('127.0.0.1', 31002)); s.listen(); time.sleep(3600)"])
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(1, 31002))
    wait_for(lambda: "31002" in box.run(["ss", "-Hltn"]).stdout, 10, "the squatter to listen")
    assert box.systemctl("start", "dsv4@alpha", check=False, timeout=60).returncode != 0
    text = show(box, "dsv4@alpha.service", "StatusText", "ExecMainStatus")
    assert text["ExecMainStatus"] == "3", text
    assert text["StatusText"].startswith("refusing to start: port 127.0.0.1:31002") and "python3 -c" in text["StatusText"], text
    journal = box.journal("dsv4@alpha")
    assert journal.count("refusing to start: port 127.0.0.1:31002") == 1, journal  # said once, not twice


def test_of_two_conflicting_starts_at_once_the_loser_says_who_won(box):
    box.install(startup=2.0, unit_extra="Restart=no\n")
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001))
    box.write_file("/etc/supervisord-gpu/profiles/beta.toml", profile(0, 31002))  # the same GPU
    box.systemctl("start", "--no-block", "dsv4@alpha", "dsv4@beta")
    wait_for(lambda: {box.is_active("dsv4@alpha"), box.is_active("dsv4@beta")} in ({"active", "inactive"},
                                                                                   {"active", "failed"}), 120, "one winner")
    time.sleep(2)  # a takeover could still be under way: both settle
    states = {n: box.is_active(f"dsv4@{n}") for n in ("alpha", "beta")}
    winner = next(n for n, s in states.items() if s == "active")
    loser = next(n for n in states if n != winner)
    said = show(box, f"dsv4@{loser}.service", "StatusText")["StatusText"] + box.journal(f"dsv4@{loser}")
    assert f"{winner} (pid " in said, said[-3000:]
    assert "CancelledError" not in said


def test_a_stop_while_starting_says_so_and_leaves_nothing(box):
    box.install(startup=30.0, unit_extra="Restart=no\n")
    box.write_file("/etc/supervisord-gpu/profiles/alpha.toml", profile(0, 31001, start_timeout=120))
    box.systemctl("start", "--no-block", "dsv4@alpha")
    wait_for(lambda: "server" in show(box, "dsv4@alpha.service", "StatusText")["StatusText"]
             and "loading" in show(box, "dsv4@alpha.service", "StatusText")["StatusText"], 30, "the load to be under way")
    box.systemctl("stop", "dsv4@alpha", timeout=60)
    journal = box.journal("dsv4@alpha")
    assert "stopped while starting; what had started is stopped" in journal, journal[-2000:]
    assert "start failed" not in journal and "CancelledError" not in journal, journal[-2000:]
    assert show(box, "dsv4@alpha.service", "StatusText")["StatusText"] in ("", "stopped: stopped while starting")
    assert box.is_active("dsv4@alpha") == "inactive" and ours(box) == []


def test_switch_dry_run_prints_the_plan_with_the_shipped_config_and_warns_about_missing_paths(box):
    box.install()
    box.write_file("/etc/supervisord-gpu/supervisord-gpu.toml",
                   (REPO / "etc" / "supervisord-gpu" / "supervisord-gpu.toml").read_text())  # production, no rehearsal
    r = box.run([CTL, "switch", "tp4-512k", "--dry-run"], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("plan: switch to tp4-512k") and "wait until GPUs 0,1,2,3 are idle" in r.stdout, r.stdout
    assert "warning: /etc/supervisord-gpu/profiles/tp4-512k.toml: servers.server.model_path:" in r.stderr, r.stderr
    real = box.run([CTL, "check", "tp4-512k"], check=False)  # a real start would refuse it: so does check
    assert real.returncode == 2 and "servers.server.model_path" in real.stderr and "does not exist" in real.stderr, real.stderr
