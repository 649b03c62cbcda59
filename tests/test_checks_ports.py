"""Port checks: real sockets held by real processes, named by PID; ours told apart by cgroup."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from supervisord_gpu.checks.holders import Holder, describe_gpu_pid, describe_pid, parse_cgroup, shorten_cmdline
from supervisord_gpu.checks.ports import _overlaps, check_port, check_ports, resolve
from supervisord_gpu.names import Owner

REPO = Path(__file__).resolve().parent.parent

LISTENER = """\
import os, socket, sys, time
host, port, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen()
pids = [os.getpid()]
for _ in range(workers):
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    pids.append(pid)
print(s.getsockname()[1], *pids, flush=True)
time.sleep(600)
"""


class Listener:
    def __init__(self, proc: subprocess.Popen[str], port: int, pids: list[int]) -> None:
        self.proc, self.port, self.pids = proc, port, pids


@pytest.fixture
def listen(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Start port_hog.py listening on host:port (0: any free port), with forked workers sharing the socket."""
    (tmp_path / "port_hog.py").write_text(LISTENER)

    def start(host: str, port: int = 0, workers: int = 0) -> Listener:
        proc = subprocess.Popen([sys.executable, "port_hog.py", host, str(port), str(workers)], cwd=tmp_path,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)

        def stop() -> None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()

        request.addfinalizer(stop)
        assert proc.stdout is not None
        bound, *pids = (int(x) for x in proc.stdout.readline().split())
        return Listener(proc, bound, pids)

    return start


def ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_free_port_is_free() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = check_port("0.0.0.0", port, "router")
    assert status.free and status.holders == () and status.error is None and status.problem() is None


def test_a_foreign_listener_is_named_with_its_pid_and_command_line(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("0.0.0.0")
    status = check_port("0.0.0.0", lst.port, "router")
    assert not status.free
    assert [h.pid for h in status.holders] == lst.pids
    line = status.problem()
    assert line is not None and line.startswith(f"port 0.0.0.0:{lst.port} (router) held by pid {lst.pids[0]} ")
    assert "port_hog.py" in line and line.endswith("(foreign)")


def test_a_loopback_listener_blocks_a_bind_of_all_addresses(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("127.0.0.1")
    status = check_port("0.0.0.0", lst.port, "router")
    assert not status.free and [h.pid for h in status.holders] == lst.pids


def test_a_listener_on_all_addresses_blocks_a_loopback_bind(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("0.0.0.0")
    status = check_port("127.0.0.1", lst.port, "prefill bootstrap")
    assert not status.free and [h.pid for h in status.holders] == lst.pids


def test_a_listener_on_another_loopback_address_does_not_block(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("127.0.0.2")
    assert check_port("127.0.0.1", lst.port, "router").free


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this machine")
def test_a_dual_stack_listener_blocks_an_ipv4_bind(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("::")
    status = check_port("0.0.0.0", lst.port, "router")
    assert not status.free and [h.pid for h in status.holders] == lst.pids
    assert check_port("::", lst.port, "router").problem().startswith(f"port [::]:{lst.port} (router) held by")  # type: ignore[union-attr]


def test_a_listener_shared_by_forked_workers_names_every_worker(listen) -> None:  # type: ignore[no-untyped-def]
    lst = listen("127.0.0.1", workers=2)
    status = check_port("127.0.0.1", lst.port, "router")
    assert sorted(h.pid for h in status.holders) == sorted(lst.pids) and len(lst.pids) == 3


def test_only_time_wait_connections_left_count_as_free() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
        client.close()
    assert check_port("127.0.0.1", port, "router").free


def test_an_address_this_machine_lacks_is_an_error_not_a_holder() -> None:
    status = check_port("192.0.2.1", 30000, "router")  # TEST-NET-1, never configured
    assert not status.free and status.error and "not configured" in status.error
    assert status.problem() == f"port 192.0.2.1:30000 (router) cannot be used: {status.error}"


def test_several_ports_are_checked_and_named_together(listen) -> None:  # type: ignore[no-untyped-def]
    a, b = listen("127.0.0.1"), listen("0.0.0.0")
    statuses = check_ports([("0.0.0.0", a.port, "router"), ("127.0.0.1", b.port, "worker"), ("127.0.0.1", 0, "any")])
    assert [[h.pid for h in s.holders] for s in statuses] == [a.pids, b.pids, []]
    assert [s.free for s in statuses] == [False, False, True]


def test_a_listener_in_a_cgroup_of_one_of_our_instances_is_attributed_to_it(listen, cgroups) -> None:  # type: ignore[no-untyped-def]
    lst = listen("0.0.0.0")
    group = cgroups.root / "pd-1p1d" / "router"
    group.mkdir(parents=True)
    (group / "cgroup.procs").write_text(str(lst.proc.pid))
    status = check_port("0.0.0.0", lst.port, "router")
    (holder,) = status.holders
    assert holder.owner == Owner("pd-1p1d", "router")
    assert holder.cgroup is not None and holder.cgroup.endswith("/supervisord-gpu/pd-1p1d/router")
    assert status.problem().endswith("(ours: instance pd-1p1d, router)")  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- holders


def test_a_pid_not_in_this_namespace_is_unknown_never_guessed() -> None:
    holder = describe_pid(4194305)  # above the kernel's largest pid_max
    assert not holder.known and holder.owner is None
    assert holder.describe() == "pid 4194305: unknown (outside this PID namespace)"


def test_an_nvml_pid_from_another_namespace_is_accepted_only_with_a_gpu_device_open() -> None:
    assert describe_gpu_pid(os.getpid(), pids_local=True).known
    assert not describe_gpu_pid(os.getpid(), pids_local=False).known  # we have no /dev/nvidia* open


def test_a_holder_line_names_pid_user_command_cgroup_and_verdict() -> None:
    h = Holder(4711, "sglang", "/opt/venv/bin/python -m sglang.launch_server --port 30001", "/system.slice/foo.service",
               "foo.service", None, True)
    assert h.describe() == ("pid 4711 (user sglang) python -m sglang.launch_server --port 30001 "
                            "[cgroup /system.slice/foo.service] (foreign)")
    ours = Holder(99, "root", "sglang-router", "/system.slice/dsv4@pd-1p1d.service/router", None,
                  Owner("pd-1p1d", "router"), True)
    assert ours.describe().endswith("(ours: instance pd-1p1d, router)")
    assert ours.short() == "pid 99 pd-1p1d/router"


def test_long_command_lines_are_cut_at_a_word() -> None:
    cmd = "python -m sglang.launch_server " + " ".join(f"--opt{i} value{i}" for i in range(40))
    short = shorten_cmdline(cmd, 100)
    assert len(short) <= 100 and short.endswith(" …") and cmd.startswith(short[:-2])


def test_the_cgroup_v2_line_is_preferred_on_hybrid_hosts() -> None:
    hybrid = "12:memory:/user.slice\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n"
    assert parse_cgroup(hybrid) == "/system.slice/a.service"
    ours = "1:name=systemd:/\n0::/supervisord-gpu/pd-1p1d/router\n"
    assert parse_cgroup(ours) == "/supervisord-gpu/pd-1p1d/router"
    v2_root_only = "1:name=systemd:/system.slice/b.service\n0::/\n"
    assert parse_cgroup(v2_root_only) == "/system.slice/b.service"
    assert parse_cgroup("0::/x.scope (deleted)\n") == "/x.scope"


@pytest.mark.parametrize(
    "want, have, blocked",
    [
        ("0.0.0.0", "127.0.0.1", True),
        ("127.0.0.1", "0.0.0.0", True),
        ("127.0.0.1", "127.0.0.2", False),
        ("0.0.0.0", "::", True),  # dual stack
        ("::", "127.0.0.1", True),
        ("::1", "127.0.0.1", False),
        ("::1", "::", True),
        ("127.0.0.1", "::ffff:127.0.0.1", True),  # IPv4-mapped counts as IPv4
        ("10.0.0.1", "::1", False),
    ],
)
def test_which_bound_addresses_block_which_binds(want: str, have: str, blocked: bool) -> None:
    assert _overlaps(resolve(want), resolve(have)) is blocked


def test_listener_ownership_tells_our_listener_from_a_strangers(listen) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.checks.ports import listener_ownership

    ours = listen("127.0.0.1", 0, workers=1)
    mine = listener_ownership("127.0.0.1", ours.port, ours.pids)
    assert mine.ours and mine.foreign == ()
    stranger = listener_ownership("127.0.0.1", ours.port, [os.getpid()])
    assert not stranger.ours and {h.pid for h in stranger.foreign} == set(ours.pids)
    assert "port_hog.py" in stranger.describe_foreign()


@pytest.mark.skipif(not ipv6_available(), reason="no IPv6 on this machine")
def test_an_ipv6_only_listener_on_the_wildcard_counts_against_an_ipv4_server(listen) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.checks.ports import listener_ownership

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    v6 = subprocess.Popen([sys.executable, "-c", (
        "import socket, time\ns = socket.socket(socket.AF_INET6)\n"
        "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n"
        f"s.bind(('::', {port})); s.listen(); print('up', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert v6.stdout is not None and v6.stdout.readline().strip() == "up"
        found = listener_ownership("0.0.0.0", port, [])
        assert [h.pid for h in found.foreign] == [v6.pid]  # `localhost` clients may resolve to ::1 and reach it
    finally:
        v6.kill()
        v6.wait()


@pytest.mark.parametrize("path, owner", [
    ("/system.slice/dsv4-pd-1p1d-router.scope", Owner("pd-1p1d", "router", "dsv4-pd-1p1d-router.scope")),
    ("/system.slice/dsv4@pd-1p1d.service", Owner("pd-1p1d", "daemon", "dsv4@pd-1p1d.service")),
    ("/supervisord-gpu/pd-1p1d/router", Owner("pd-1p1d", "router")),
    # the same names inside what a user's own systemd manager delegates to them: not ours
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/dsv4-pd-1p1d-router.scope", None),
    ("/user.slice/user-1000.slice/user@1000.service/dsv4@pd-1p1d.service", None),
    ("/user.slice/user-1000.slice/user@1000.service/supervisord-gpu/pd-1p1d/router", None),
    ("/system.slice/evil.service/dsv4-pd-1p1d-router.scope", None),
])
def test_only_a_cgroup_where_only_root_can_put_it_counts_as_ours(path, owner) -> None:  # type: ignore[no-untyped-def]
    from supervisord_gpu.names import owner_of_cgroup

    assert owner_of_cgroup(path) == owner


def test_accepted_by_names_whoever_holds_this_connections_other_end(listen) -> None:  # type: ignore[no-untyped-def]
    """The check before a key or a liveness verdict: which process accepted *this* connection."""
    from supervisord_gpu.checks.ports import accepted_by

    hog = listen("127.0.0.1", 0)  # listens, never accepts: the connection waits in its queue
    with socket.create_connection(("127.0.0.1", hog.port)) as c:
        assert accepted_by(c.getsockname(), c.getpeername(), hog.pids) is None

    families = [("127.0.0.1", socket.AF_INET, "127.0.0.1")]
    if ipv6_available():  # a dual-stack listener: the accepted socket is in tcp6 as ::ffff:127.0.0.1
        families.append(("::", socket.AF_INET6, "127.0.0.1"))
    for bind, family, connect in families:
        with socket.socket(family) as server:
            server.bind((bind, 0))
            server.listen()
            with socket.create_connection((connect, server.getsockname()[1])) as c:
                accepted, _ = server.accept()
                with accepted:
                    ours = accepted_by(c.getsockname(), c.getpeername(), [os.getpid()])
                    theirs = accepted_by(c.getsockname(), c.getpeername(), hog.pids)
        assert ours is not None and ours.ours and ours.why_not() == "", (bind, ours)
        assert theirs is not None and not theirs.ours and theirs.stranger.startswith(f"pid {os.getpid()} "), theirs
        assert theirs.why_not().startswith("it was accepted by pid")
