"""dsv4@.service's sandbox under a real systemd: its exposure, and what of it reaches SGLang.

The servers are forked from the daemon, so namespaces, the capability bounding set,
no_new_privs and the system-call filter of the service are theirs too. These tests read them
off a running stand-in server (as the kernel reports them in /proc/PID), and check that the
proof run on an H200 (bench/device/sandbox_check.py: CUDA, NCCL and the daemon's torch
stand-in under the same sandbox) covered exactly the filter this unit asks systemd for.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from box import box, ours  # noqa: F401  (box is a fixture)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
PROOF_SYSCALLS = REPO / "bench" / "device" / "allowed-syscalls.txt"
CAPS = {"CAP_CHOWN": 0, "CAP_DAC_READ_SEARCH": 2, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7,
        "CAP_SYS_PTRACE": 19}


def unit_setting(name: str) -> list[str]:
    return [line.split("=", 1)[1] for line in (REPO / "units" / "dsv4@.service").read_text().splitlines()
            if line.startswith(f"{name}=")]


def test_the_unit_exposure_is_at_most_4(box):
    box.install()
    out = box.run(["systemd-analyze", "security", "--no-pager", "dsv4@test.service"], check=False).stdout
    score = float(re.search(r"Overall exposure level for dsv4@test.service: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    print(f"loaded dsv4@test.service: exposure {score}")  # the README's figure (pytest -s)
    assert score <= 4.0, out[-3000:]


def test_the_h200_proof_covered_exactly_the_system_calls_this_unit_allows(box):
    box.install()
    groups: dict[str, list[str]] = {}
    current = None
    for line in box.run(["systemd-analyze", "syscall-filter", "--no-pager"]).stdout.splitlines():
        if line.startswith("@"):
            current = line.split()[0]
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.split()[0])

    def expand(names: list[str]) -> set[str]:
        out: set[str] = set()
        for n in names:
            out |= expand(groups[n]) if n.startswith("@") else {n}
        return out

    allowed: set[str] = set()
    for value in unit_setting("SystemCallFilter"):
        if value.startswith("~"):
            allowed -= expand(value[1:].split())
        else:
            allowed |= expand(value.split())
    assert allowed == set(PROOF_SYSCALLS.read_text().split()), (
        "the unit's SystemCallFilter= changed: regenerate bench/device/allowed-syscalls.txt and prove it on the H200 again")


def test_the_sandbox_reaches_the_servers_running_as_their_own_user(box):
    box.install(startup=0.5)
    box.systemctl("start", "dsv4@tp4-512k", timeout=120)
    server = next(p for p in ours(box) if p.cgroup.endswith("dsv4-tp4-512k-server.scope"))
    status = dict(line.split(":", 1) for line in box.read_file(f"/proc/{server.pid}/status").splitlines() if ":" in line)
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"  # no_new_privs, a filter
    assert int(status["CapBnd"], 16) == sum(1 << n for n in CAPS.values())
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0  # as user sglang: no capabilities
    uid = int(status["Uid"].split()[0])
    assert box.run(["getent", "passwd", "sglang"]).stdout.split(":")[2] == str(uid)
    mounts = box.read_file(f"/proc/{server.pid}/mountinfo").splitlines()
    root = next(m for m in mounts if m.split()[4] == "/")
    assert " ro," in f" {root.split()[5]}," or root.split()[5].startswith("ro"), root  # ProtectSystem=strict
    proc = next(m for m in mounts if m.split()[4] == "/proc" and "proc" in m.split(" - ")[1])
    assert "hidepid=invisible" in proc, proc  # ProtectProc=invisible
    # PrivateTmp=yes: not the container's /tmp (the private one is mounted over it: the last one counts)
    tmp = [m for m in mounts if m.split()[4] == "/tmp"][-1]
    assert tmp.split()[3] != "/", tmp
    box.systemctl("stop", "dsv4@tp4-512k", timeout=120)
