"""PD -> TP4 and back under a real systemd, with stand-in servers and the real sglang-router."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from box import box, host_box, ours, stand_ins  # noqa: F401  (box, host_box are fixtures)
from support import free_ports

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

DECOY = ["systemd-run", "--unit=decoy", "--collect", "python3", "-c", "import time; time.sleep(3600)",
         "-m", "sglang.launch_server", "--port", "30001"]


def free_port() -> int:
    return free_ports(1)[0]


def events(box, unit: str, event: str) -> list[dict]:  # type: ignore[no-untyped-def]
    out = box.journal(unit, f"GPUSUP_EVENT={event}", "-o", "json")
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def decoy_alive(box) -> bool:  # type: ignore[no-untyped-def]
    return box.is_active("decoy.service") == "active"


class RequestLoop:
    """Requests through port 30001 all along; a request is lost if it was accepted and then failed."""

    def __init__(self) -> None:
        self.ok = self.refused = self.unavailable = 0
        self.lost: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 30}}).encode()
        while not self.stop.is_set():
            req = urllib.request.Request("http://127.0.0.1:30001/generate", data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=20) as r:
                    r.read()
                    self.ok += 1
            except urllib.error.HTTPError as e:
                text = e.read(300).decode(errors="replace")
                if e.code == 503:
                    self.unavailable += 1  # refused by a server that is not serving (yet or any more): not accepted
                    time.sleep(0.05)
                else:
                    self.lost.append(f"{time.time():.3f} {e.code} {text}")
            except urllib.error.URLError as e:
                if isinstance(e.reason, ConnectionRefusedError):
                    self.refused += 1  # not accepted: the client knows at once and may retry
                    time.sleep(0.05)
                else:
                    self.lost.append(str(e))
            except ConnectionResetError as e:
                self.lost.append(f"{time.time():.3f} {e!r}")

    def __enter__(self) -> "RequestLoop":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.xdist_group("host-network")  # the client loop runs on the host
def test_pd_to_tp4_and_back_in_order_verified_and_without_losing_a_request(host_box):
    box = host_box
    port = free_port()
    box.install(startup=1.0, metrics_port=port)
    # every generation takes 0.3 s (30 tokens x 10 ms), so requests are in flight when the router drains
    for name in ("pd-1p1d", "tp4-512k"):
        path = f"/etc/supervisord-gpu/profiles/{name}.toml"
        box.write_file(path, box.read_file(path) + "".join(
            f'\n[servers.{s}.env]\nSUPERVISORD_GPU_STANDIN_TOKEN_S = "0.01"\n'
            for s in (("prefill", "decode") if name == "pd-1p1d" else ("server",))))
    box.run(DECOY)
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    with RequestLoop() as loop:
        time.sleep(1.0)
        box.systemctl("start", "dsv4@tp4-512k", timeout=180)
        time.sleep(1.0)
    why = box.systemctl("status", "dsv4@pd-1p1d", check=False).stdout + box.journal("dsv4@pd-1p1d")[-3000:]
    assert box.is_active("dsv4@tp4-512k") == "active" and box.is_active("dsv4@pd-1p1d") == "inactive", why
    order = [e["GPUSUP_PROCESS"] for e in events(box, "dsv4@pd-1p1d", "stopped")]
    assert order == ["router", "decode", "prefill"]
    verified = events(box, "dsv4@tp4-512k", "transition")
    verified_at = next(int(e["__REALTIME_TIMESTAMP"]) for e in verified if "verified idle" in e["MESSAGE"])
    started_at = int(events(box, "dsv4@tp4-512k", "spawn")[0]["__REALTIME_TIMESTAMP"])
    assert verified_at < started_at
    assert loop.ok > 5 and loop.lost == [], loop.lost
    drained = [e for e in box.journal("dsv4@pd-1p1d", "GPUSUP_PROCESS=router").splitlines() if "graceful shutdown" in e]
    assert drained, "the router was not asked to drain"
    assert decoy_alive(box)
    # the takeover was timed, from what it stopped to what it started (the new daemon's metrics)
    timed = [l for l in scrape(port).splitlines() if l.startswith("supervisord_gpu_transition_seconds_count{")]
    assert [(sorted(l[l.index("{") + 1:l.index("}")].split(",")), l.split()[-1]) for l in timed] == [
        (['from="pd-1p1d"', 'outcome="ok"', 'to="tp4-512k"'], "1.0")], timed

    box.systemctl("start", "dsv4@pd-1p1d", timeout=180)
    assert box.is_active("dsv4@pd-1p1d") == "active" and box.is_active("dsv4@tp4-512k") == "inactive"
    assert decoy_alive(box)
    box.systemctl("stop", "dsv4@pd-1p1d", timeout=120)
    assert ours(box) == [] and decoy_alive(box)


def test_a_switch_to_a_profile_with_a_bad_sglang_flag_leaves_pd_running_and_says_why(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    before = {p.pid for p in stand_ins(box)}
    bad = box.read_file("/etc/supervisord-gpu/profiles/tp4-512k.toml").replace("tp-size = 4", "tp-size = 4\ncuda-graph-max-bs = 8")
    box.write_file("/etc/supervisord-gpu/profiles/tp4-512k.toml", bad)
    assert box.systemctl("start", "dsv4@tp4-512k", check=False, timeout=60).returncode != 0
    assert box.is_active("dsv4@pd-1p1d") == "active" and {p.pid for p in stand_ins(box)} == before
    assert "ambiguous option: --cuda-graph-max-bs could match" in box.journal("dsv4@tp4-512k")
    switch = box.run([f"{box_repo()}/.venv/bin/gpusupctl", "switch", "tp4-512k", "--dry-run"], check=False)
    assert switch.returncode == 2 and "cuda-graph-max-bs" in switch.stderr


def test_a_tp4_server_that_fails_to_start_rolls_back_to_pd(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    bad = box.read_file("/etc/supervisord-gpu/profiles/tp4-512k.toml").replace("start_timeout = 900", "start_timeout = 3").replace(
        "[servers.server.options]", '[servers.server.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "never-ready"\n[servers.server.options]')
    box.write_file("/etc/supervisord-gpu/profiles/tp4-512k.toml", bad)
    assert box.systemctl("start", "dsv4@tp4-512k", check=False, timeout=120).returncode != 0
    deadline = time.monotonic() + 60
    while box.is_active("dsv4@pd-1p1d") != "active" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert box.is_active("dsv4@pd-1p1d") == "active"
    assert any("rollback" in e["MESSAGE"] for e in events(box, "dsv4@tp4-512k", "rollback"))
    # STATUS= ends with the reason and the rollback's outcome, and the exit status is final (5)
    shown = box.run(["systemctl", "show", "-p", "StatusText", "-p", "ExecMainStatus", "dsv4@tp4-512k"]).stdout
    assert "ExecMainStatus=5" in shown, shown
    assert "StatusText=failed: " in shown and "rolled back: dsv4@pd-1p1d started again" in shown, shown


def test_a_foreign_holder_stops_the_switch_before_teardown_naming_it(box):
    box.install(startup=0.5, unit_extra="Restart=no\n")
    box.systemctl("start", "dsv4@tp4-512k", timeout=120)
    box.run(["systemd-run", "--unit=squatter", "--collect", "python3", "-c",
             "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.bind(('127.0.0.1', 30100)); s.listen(); time.sleep(3600)"])
    time.sleep(0.5)
    r = box.systemctl("start", "dsv4@pd-1p1d", check=False, timeout=60)
    assert r.returncode != 0
    assert box.is_active("dsv4@tp4-512k") == "active"
    journal = box.journal("dsv4@pd-1p1d")
    assert "refusing to start" in journal and "30100" in journal and "squatter.service" in journal and "(foreign)" in journal


def test_gpusupctl_switch_dry_run_prints_the_ordered_plan(box):
    box.install(startup=0.5)
    box.systemctl("start", "dsv4@pd-1p1d", timeout=120)
    out = box.run([f"{box_repo()}/.venv/bin/gpusupctl", "switch", "tp4-512k", "--from", "pd-1p1d", "--dry-run"]).stdout
    assert "plan: switch to tp4-512k from pd-1p1d" in out
    assert "stop dsv4@pd-1p1d (systemd): router -> decode -> prefill" in out
    assert "wait until GPUs 0,1,2,3 are idle and 127.0.0.1:30300, 0.0.0.0:30001, 127.0.0.1:30092 free" in out
    assert box.is_active("dsv4@pd-1p1d") == "active"  # a dry run touches nothing


def box_repo() -> str:
    from box import REPO

    return str(REPO)
