"""A hostile read of the routers, hang, sharing and parking code: each test plays the party who
owns an input (a child's model code, a local user) and checks the daemon keeps its bounds."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisord_gpu.controller.parking import one_generation
from supervisord_gpu.engine.hang_sampler import STACKS_MAX_BYTES, dump_stacks
from supervisord_gpu.parking.binary import BinaryCheckpointer
from supervisord_gpu.parking.checkpointer import CheckpointUnavailable

MIB = 1 << 20


class EndlessAnswer:
    """The child's server (its model code answers every route): `200 OK`, then up to `total`
    bytes of body, then the connection held open. `sent` says how much the daemon took."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(30)
            conn.recv(65536)
            chunk = b'{"text": "' + b"x" * MIB
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
                while self.sent < self.total:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
                self.done.wait(30)  # held open: no end of the body
            except OSError:
                pass  # the daemon stopped reading and closed: what we want

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close()


def test_a_childs_endless_answer_to_the_restores_generation_costs_the_daemon_at_most_a_few_mib():
    """Party: the parked server's model code. The restore's proof of serving (POST /generate,
    controller/parking.one_generation) and PD readiness's first request read the answer; an
    endless one used to be read in full into the root daemon's memory until the timeout."""
    fake = EndlessAnswer(total=128 * MIB)
    try:
        began = time.monotonic()
        why = asyncio.run(one_generation("127.0.0.1", fake.port, timeout=8.0))
        took = time.monotonic() - began
    finally:
        fake.close()
    assert fake.sent < 32 * MIB, f"the daemon read {fake.sent / MIB:.0f} MiB of the child's answer"
    assert why == "" and took < 5.0, (why, took)


def _fake_py_spy(path: Path, marker: Path, mib: int) -> None:
    path.write_text(f"#!{sys.executable}\nimport sys\n"
                    f"for _ in range({mib}):\n    sys.stdout.write('    deep (model.py:1)\\n' * 50000)\n"
                    f"sys.stdout.flush()\nopen({str(marker)!r}, 'w').close()\n")
    path.chmod(0o755)


def test_stacks_past_their_bound_are_not_read_on_and_py_spy_is_ended(tmp_path):
    """Party: the hung server's model code, whose function names, depth and threads make py-spy's
    output as long as it likes; only the journal's 32 KiB of it may reach the daemon's memory."""
    fake, marker = tmp_path / "py-spy", tmp_path / "printed-it-all"
    _fake_py_spy(fake, marker, 64)
    text = asyncio.run(dump_stacks(1, 20.0, str(fake)))
    assert not marker.exists(), "py-spy was read to its end (64 MiB in the daemon's memory)"
    assert text.startswith("    deep (model.py:1)\n") and text.endswith("... (cut)")
    assert len(text) <= STACKS_MAX_BYTES + 20


@pytest.mark.skipif(os.geteuid() != 0, reason="the check guards what root runs")
@pytest.mark.parametrize("writable", ["directory", "file"])
def test_cuda_checkpoint_and_py_spy_on_a_path_a_user_can_write_are_never_run_as_root(tmp_path, monkeypatch, writable):
    """Party: a local user who can write a directory on the daemon's PATH (a venv, a build tree).
    Root would run their `cuda-checkpoint` on every park and their `py-spy` before a hang kill."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "ran"
    for name in ("cuda-checkpoint", "py-spy"):
        (bindir / name).write_text(f"#!/bin/sh\ntouch {marker}\necho running\n")
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    assert BinaryCheckpointer.open().path == str(bindir / "cuda-checkpoint")  # root's alone: found
    if writable == "directory":
        bindir.chmod(0o777)
    else:
        for name in ("cuda-checkpoint", "py-spy"):
            (bindir / name).chmod(0o777)
    with pytest.raises(CheckpointUnavailable, match="not root's alone"):
        BinaryCheckpointer.open()
    text = asyncio.run(dump_stacks(1, 5.0))
    assert text.startswith("py-spy not run: ") and "writable by non-root users" in text, text
    assert not marker.exists()


class Stranger:
    """A local user's listener that answers every request `200 OK {}`."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.asked = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    if not conn.recv(65536):
                        continue  # connected, nothing sent: the peer check refused it
                    self.asked += 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                except OSError:
                    pass


def test_a_stranger_on_the_port_of_a_parked_front_end_does_not_prove_the_restore():
    """Party: a local user who binds the serving port of a parked profile whose front end died
    (a parked process may end; the port is then anyone's). The restore's proof of serving used
    no peer check: the stranger's 200 made a dead profile 'restored and serving'."""
    from types import SimpleNamespace

    from test_parking import run, setup

    stranger = Stranger()
    try:
        parker, _ckpt, inst, said = setup()
        inst.profile.processes = [SimpleNamespace(name="server", serves_http=True, kind="server",
                                                  probe_host="127.0.0.1", port=stranger.port, listens=lambda: [])]
        run(parker.park(inst))
        cold: list[str] = []

        async def cold_start() -> None:
            cold.append("cold")

        verdict = run(parker.restore(inst, cold_start))
    finally:
        stranger.sock.close()
    assert stranger.asked == 0, "the proof of serving was sent to the stranger"
    assert not verdict.serve and cold == ["cold"], verdict.say
    assert "not by server" in verdict.say, verdict.say


def test_a_pid_that_ended_while_parked_is_never_restored_it_may_be_anyones_now():
    """Party: the parked profile's model code, which can end its own parked scheduler (or the
    OOM killer does): its PID is then free for any process of the machine, another instance's
    CUDA process included, and NVIDIA's utility has one verb for both ways (--toggle), so a
    restore of that PID would checkpoint a stranger's server. The restore used the PIDs of the
    park without asking whether they are still the profile's."""
    from test_parking import run, setup

    parker, ckpt, inst, said = setup()
    run(parker.park(inst))
    inst.processes["server"].spawned.group.pids = lambda: [100]  # 101 ended while parked
    cold: list[str] = []

    async def serves() -> str:
        return ""

    async def cold_start() -> None:
        cold.append("cold")

    verdict = run(parker.restore(inst, cold_start, serves))
    assert ("restore", 101) not in ckpt.calls, "a PID no longer the profile's was restored"
    assert not verdict.serve and cold == ["cold"] and "pid 101 is no longer tp1's" in verdict.say, verdict.say


def test_cuda_checkpoint_never_toggles_a_running_process_on_restore():
    """--toggle of a running process checkpoints it: a restore toggles only a checkpointed one."""
    import subprocess

    from supervisord_gpu.parking.checkpointer import CheckpointError

    argvs: list[list[str]] = []

    def fake_run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        argvs.append(argv)
        return subprocess.CompletedProcess(argv, 0, "running\n", "")

    b = BinaryCheckpointer("/usr/bin/cuda-checkpoint", fake_run)
    with pytest.raises(CheckpointError, match="is running"):
        b.restore(4242)
    assert not any("--toggle" in a for a in argvs), argvs


def test_a_childs_megabytes_of_argv_are_not_read_at_every_look(monkeypatch):
    """Party: a server's model code, which execs a process of its cgroup with a 1.5 MB argv (and
    can fork many): the hang watch read each one's whole /proc/PID/cmdline every 2 s, to find a
    role in its first 15 bytes."""
    import subprocess

    from supervisord_gpu.engine import hang_sampler
    from supervisord_gpu.engine.hang_sampler import GpuUtilization, HangSampler

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", *(["x" * 100_000] * 15)])
    read: list[int] = []
    real = hang_sampler.read_text

    def recording(pid: int, name: str, *args: int) -> str | None:
        text = real(pid, name, *args)
        if name == "cmdline":
            read.append(len(text or ""))
        return text

    monkeypatch.setattr(hang_sampler, "read_text", recording)

    async def nothing() -> tuple[int | None, bytes]:
        return None, b""

    try:
        time.sleep(0.2)
        samples = HangSampler(0, lambda: [child.pid], nothing, nothing, GpuUtilization([])).processes()
    finally:
        child.kill()
        child.wait()
    assert [s.role for s in samples] == [""] and read, (samples, read)
    assert max(read) <= 4096, f"read {max(read)} bytes of the child's cmdline"


def test_a_function_named_like_a_daemon_line_does_not_forge_one_in_the_stacks(monkeypatch):
    """Party: the hung server's model code, whose function names reach the stacks py-spy prints.
    A name with a newline and `supervisord-gpu: ...` in it read as a line of the daemon's own in
    the text output of `supervisord-gpu run` (printable() keeps newlines: the stacks need them)."""
    import io
    from types import SimpleNamespace

    from supervisord_gpu.engine import process
    from supervisord_gpu.engine.hang import HangVerdict
    from supervisord_gpu.engine.states import ProcessState
    from supervisord_gpu.systemd.journal import StderrSink

    async def forged(pid: int, timeout: float) -> str:
        return 'Thread 7 (idle): "MainThread"\n    f (model.py:1)\nsupervisord-gpu: instance ready in 1.00 s'

    monkeypatch.setattr(process, "dump_stacks", forged)
    out = io.StringIO()
    me = SimpleNamespace(name="main", sink=StderrSink("a", stream=out, colour=False), state=ProcessState.STOPPING,
                         _stopping=True, _exited=asyncio.Event(), spawned=None, signals_sent={})
    asyncio.run(process.ManagedProcess._kill_hung(me, HangVerdict(kill="stopped", evidence="e", pids=(7,))))  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    ours = [line for line in lines if line.startswith("supervisord-gpu:")]
    assert len(ours) == 2 and all(line.startswith("supervisord-gpu: main: ") for line in ours), lines
    assert any("f (model.py:1)" in line for line in lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="the children of a daemon not run as root are its own user's")
def test_a_module_planted_in_the_daemons_working_directory_is_not_what_a_child_runs(tmp_path, monkeypatch):
    """Party: a local user who can write the directory root ran `supervisord-gpu run` from
    (/tmp, a shared checkout). `python3 -m smg` (the router the daemon picks when router_command
    is unset), `python3 -m sglang.launch_server` and the key shims' `python3 -c` put the working
    directory first on sys.path, and the children inherited the daemon's: the user's module ran
    as the router or server, with its key."""
    from supervisord_gpu.ownership.base import SpawnRequest
    from supervisord_gpu.ownership.session import SessionDriver

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    marker = tmp_path / "planted-ran"
    (shared / "planted_router.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(shared)

    async def go() -> int:
        spawned = await SessionDriver().spawn(SpawnRequest("a", "router", [sys.executable, "-m", "planted_router"],
                                                           {"PATH": "/usr/bin:/bin"}))
        return await asyncio.wait_for(spawned.proc.wait(), 20)

    code = asyncio.run(go())
    assert not marker.exists(), "the local user's module ran as the child"
    assert code != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another uid's directory of holdings (chown)")
def test_another_users_claim_in_the_shared_holders_directory_does_not_park_or_restore_our_pid(tmp_path):
    """Party: another local user of a rehearsal box (holders/ is 1777 by design: the stand-ins run
    as the profiles' users). The simulated checkpointer looked for `.parked.PID.json` in every
    user's directory: a file of theirs naming our PID said it was checkpointed, and would have
    been restored (renamed) in place of ours."""
    import json

    from supervisord_gpu.checks.gpus import SimulatedInventory
    from supervisord_gpu.checks.simgpu import SimulatedGpus
    from supervisord_gpu.parking.checkpointer import CheckpointState
    from supervisord_gpu.parking.simulated import SimulatedCheckpointer

    sim = SimulatedGpus.create(tmp_path / "simgpu", 1, total_mib=1000, reserved_mib=0)
    sim.hold([0], 600)
    me = os.getpid()
    theirs = sim.directory / "holders" / "12345"
    theirs.mkdir()
    claim = theirs / f".parked.{me}.json"
    # our true start time (anyone reads it in /proc/PID/stat): a claim for a process alive, not a dead one's
    claim.write_text(json.dumps({"pid": me, "create_time": __import__("psutil").Process(me).create_time(), "gpus": [0], "mib": 0}))
    os.chown(claim, 12345, 12345)
    os.chown(theirs, 12345, 12345)
    ckpt = SimulatedCheckpointer(sim)
    assert ckpt.state(me) == CheckpointState.RUNNING, "another user's file made our PID checkpointed"
    ckpt.lock(me, 1000)
    ckpt.checkpoint(me)
    assert SimulatedInventory(sim).snapshot([0])[0].idle
    ckpt.restore(me)
    ckpt.unlock(me)
    assert SimulatedInventory(sim).snapshot([0])[0].used_mib == 600 and claim.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="plays two other uids' directories of holdings (chown)")
@pytest.mark.parametrize("name", [".parked.{pid}.json", "{pid}.json"])
def test_a_holders_directory_swapped_for_a_link_does_not_aim_roots_removal_at_another_users_holding(
        tmp_path, monkeypatch, name):
    """Party: any local user of a box with simulated GPUs (holders/ is 1777: each user adds a
    directory of their own, and may rename it away and put a symlink in its place). A reader
    removes dead holdings, and now dead parked ones, by their path: root (the rehearsal's daemon,
    `sudo gpusupctl status`) parsed a dead claim in the user's directory, and by the time it
    removed it the directory was a link to a victim's, so it removed the victim's file of that
    name instead: another user's parked holding (their restore then starts cold), or their live
    one (their GPU read free). The swap is played where the reader decides the claim is dead,
    the moment a racing user aims at (holders() runs every few milliseconds)."""
    import json

    import psutil

    from supervisord_gpu.checks import simgpu

    sim = simgpu.SimulatedGpus.create(tmp_path / "simgpu", 1, total_mib=1000, reserved_mib=0)
    me = os.getpid()
    holders = sim.directory / "holders"
    victim, attacker = holders / "22222", holders / "33333"
    victim.mkdir()
    attacker.mkdir()
    target = victim / name.format(pid=me)
    target.write_text(json.dumps({"pid": me, "create_time": psutil.Process(me).create_time(), "gpus": [0], "mib": 100}))
    bait = attacker / name.format(pid=me)
    bait.write_text(json.dumps({"pid": me, "create_time": 1.0, "gpus": [0], "mib": 1}))  # dead: another start time
    for path, uid in ((target, 22222), (victim, 22222), (bait, 33333), (attacker, 33333)):
        os.chown(path, uid, uid)
    alive = simgpu._alive

    def alive_then_swapped(pid: int, create_time: float, boot: float | None = None) -> bool:
        if create_time == 1.0 and attacker.is_dir() and not attacker.is_symlink():
            attacker.rename(holders / "33333.away")
            attacker.symlink_to(victim)
        return alive(pid, create_time, boot)

    monkeypatch.setattr(simgpu, "_alive", alive_then_swapped)
    sim.holders()
    assert target.exists(), "root removed the victim's holding through the user's swapped-in link"


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another uid's directory (chown)")
def test_simulated_gpus_a_local_user_made_first_are_not_what_root_reads_and_parks_in(tmp_path):
    """Party: a local user who makes the simulated GPUs' directory before root does (a
    `rehearsal.simgpu_dir` under /tmp, say). `SimulatedGpus.create` refuses another user's
    directory, but one that already had its `devices.json` was used as it was: that user wrote
    the GPUs root decides by, and owned the holders/ above root's own holdings, which root's
    parker (now on every `gpus.backend = "simulated"` daemon) renames as root by path."""
    import textwrap

    from supervisord_gpu.checks.gpus import inventory_for
    from supervisord_gpu.checks.simgpu import SimulatedGpus
    from supervisord_gpu.config.loader import load_daemon_config
    from supervisord_gpu.errors import SupervisorError

    theirs = tmp_path / "shared" / "simgpu"
    SimulatedGpus.create(theirs, 8)  # as that user would have: then handed to them
    for path in (theirs, theirs / "holders", theirs / "devices.json"):
        os.chown(path, 12345, 12345)
    etc = tmp_path / "etc"
    (etc / "profiles").mkdir(parents=True)
    (etc / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        runtime_dir = "{tmp_path / 'run'}"
        cache_dir = "{tmp_path / 'cache'}"
        default_user = "root"
        [gpus]
        backend = "simulated"
        [rehearsal]
        simgpu_dir = "{theirs}"
        """))
    cfg = load_daemon_config(etc)
    with pytest.raises(SupervisorError, match="uid 12345"):
        inventory_for(cfg, simulated=False)
    os.chown(theirs, 0, 0)
    with pytest.raises(SupervisorError, match="holders"):
        inventory_for(cfg, simulated=False)  # their holders/ under our directory: they rename our holdings' directory
    os.chown(theirs / "holders", 0, 0)
    with pytest.raises(SupervisorError, match="devices.json"):
        inventory_for(cfg, simulated=False)  # the GPUs they wrote
    os.chown(theirs / "devices.json", 0, 0)
    assert inventory_for(cfg, simulated=False).count() == 8, "root's own, as create() leaves it"
