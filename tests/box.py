"""A clean real systemd (the rig) with our unit, D-Bus policy, config and shipped profiles installed.

The unit runs this checkout's daemon from the project's virtual environment (the repo is
bound read-only at its own path); `rehearsal.enabled` makes the servers stand-ins on
simulated GPUs shared by every instance in the container, and the router the real one.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DAEMON = f"{REPO}/.venv/bin/supervisord-gpu"
CONFIG = """
[daemon]
start_stall_timeout = {stall}
# The tests' own profiles run their stand-ins as root; the shipped ones say user = "sglang" (the
# servers) and "sglang-router" (the router).
default_user = "root"
# sglang-router 0.3.2 here (smg is installed too: it would be picked, and stops 6.5 s slower)
[sglang]
router_command = ["python3", "-m", "sglang_router.launch_router"]
[rehearsal]
enabled = true
server_startup = {startup}
server_mib_per_gpu = 1000
"""
PACKAGE_USERS = ("sglang", "sglang-router")  # the servers' and the router's, as the .deb's postinst makes them
METRICS = """
[metrics]
enabled = true
host = "127.0.0.1"
port = {port}
"""


def checkout_settings() -> str:
    """[Service] lines that make this checkout visible to a unit running it, wherever it lies:
    bound into the service's namespace (under PrivateTmp=yes a clone in /tmp is invisible), and
    for a checkout in /root or /home, those replaced by a tmpfs holding only the bind
    (ProtectHome=tmpfs): the servers' user `sglang` cannot enter a 0700 /root, and the agent's
    ProtectHome=yes hides it from root too. The package itself lives in /usr and needs neither."""
    lines = [f"BindReadOnlyPaths={REPO}"]
    if any(REPO.is_relative_to(home) for home in ("/root", "/home", "/run/user")):
        lines.insert(0, "ProtectHome=tmpfs")
    return "# tests: this checkout, wherever it lies\n" + "\n".join(lines) + "\n"


def unit_text(drop: str = "") -> str:
    """The shipped unit, running this checkout's daemon (checkout_settings says how it sees it)."""
    text = (REPO / "units" / "dsv4@.service").read_text()
    text = text.replace("ExecStart=/usr/bin/supervisord-gpu run %i", f"ExecStart={DAEMON} run %i")
    return text.replace("\n[Install]", f"\n{checkout_settings()}\n[Install]", 1) + drop


def install(ctr, startup: float = 1.0, stall: float = 120.0, unit_extra: str = "",  # type: ignore[no-untyped-def]
            metrics_port: int | None = None) -> None:
    """Our unit, D-Bus policy, config, shipped profiles and the package's users, as the .deb would."""
    ctr.write_file("/etc/systemd/system/dsv4@.service", unit_text())
    if unit_extra:
        ctr.write_file("/etc/systemd/system/dsv4@.service.d/test.conf", "[Service]\n" + unit_extra)
    ctr.write_file("/etc/supervisord-gpu/supervisord-gpu.toml", CONFIG.format(startup=startup, stall=stall)
                   + (METRICS.format(port=metrics_port) if metrics_port else ""))
    for p in (REPO / "etc" / "supervisord-gpu" / "profiles").glob("*.toml"):
        ctr.write_file(f"/etc/supervisord-gpu/profiles/{p.name}", p.read_text())
    ctr.write_file("/etc/dbus-1/system.d/org.supervisordgpu.conf",
                   (REPO / "etc" / "dbus-1" / "system.d" / "org.supervisordgpu.conf").read_text())
    ctr.run(["groupadd", "-f", "--system", "gpusup"])
    for user in PACKAGE_USERS:  # what the .deb's postinst creates
        if ctr.run(["getent", "passwd", user], check=False).returncode != 0:
            ctr.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                     "--shell", "/usr/sbin/nologin", user])
    ctr.systemctl("reload", "dbus")
    ctr.daemon_reload()


def install_package(ctr, deb: Path) -> None:  # type: ignore[no-untyped-def]
    """The built .deb, as an operator installs it (its dependencies are in the host's Debian)."""
    r = ctr.run(["dpkg", "-i", f"/debs/{deb.name}"], check=False, timeout=180)
    assert r.returncode == 0, f"dpkg -i {deb.name} failed:\n{r.stdout}\n{r.stderr}"
    # The real sglang-router for the rehearsal's router, from the project's virtual environment:
    # a .pth in Debian's own dist-packages is read last, so every Debian package (ours,
    # python3-etcd3gw, psutil, pydbus) still wins and only what Debian lacks comes from there.
    ctr.write_file("/usr/lib/python3/dist-packages/zz-tests-sglang-router.pth", sysconfig.get_paths()["purelib"] + "\n")
    # the checkout holding that environment, visible under the unit's PrivateTmp (CI clones into /tmp)
    ctr.write_file("/etc/systemd/system/dsv4@.service.d/tests-checkout.conf", f"[Service]\n{checkout_settings()}")


PACKAGE_CONFIG = "/etc/supervisord-gpu/supervisord-gpu.toml"


def rehearse_in_package_config(ctr, server_startup: float) -> None:  # type: ignore[no-untyped-def]
    """Switch rehearsal on in the package's own config (no GPU here: stand-ins), its servers
    loading for `server_startup` s; everything else as the .deb shipped it."""
    head, _, tail = ctr.read_file(PACKAGE_CONFIG).partition("[rehearsal]\n")
    rehearsal = tail.replace("enabled = false", "enabled = true", 1).replace(
        "server_startup = 3.0", f"server_startup = {server_startup:g}", 1)
    assert "enabled = true" in rehearsal and f"server_startup = {server_startup:g}" in rehearsal, tail
    ctr.write_file(PACKAGE_CONFIG, head + "[rehearsal]\n" + rehearsal)


@pytest.fixture
def box(fresh_systemd_container):  # type: ignore[no-untyped-def]
    """A clean systemd with our unit, policy, config and the shipped profiles installed, on a
    network of its own (loopback only: its 30001 is not the host's)."""
    ctr = fresh_systemd_container()
    ctr.install = lambda **kw: install(ctr, **kw)  # type: ignore[attr-defined]
    return ctr


@pytest.fixture
def host_box(fresh_systemd_container):  # type: ignore[no-untyped-def]
    """The box on the host's network, for a test whose client runs on the host. Such a test
    must be marked ``pytest.mark.xdist_group("host-network")``: the shipped profiles' ports are
    the host's then, and two at once would collide."""
    ctr = fresh_systemd_container(host_network=True)
    ctr.install = lambda **kw: install(ctr, **kw)  # type: ignore[attr-defined]
    return ctr


def server_profile(gpu: int, port: int, start_timeout: float = 10, fault: str = "", extra: str = "") -> str:
    """A one-server profile for the box: the stand-in on `gpu` and `port`, with an optional fault."""
    env = f'[servers.server.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "{fault}"\n' if fault else ""
    return f"""
[servers.server]
gpus = [{gpu}]
port = {port}
model_path = "/m"
start_timeout = {start_timeout:g}
{env}
{extra}"""


def ours(ctr) -> list:  # type: ignore[no-untyped-def]
    """Every process in a dsv4 unit or scope."""
    return [p for p in ctr.processes() if "/dsv4" in p.cgroup]


def stand_ins(ctr) -> list:  # type: ignore[no-untyped-def]
    return [p for p in ctr.processes()
            if any("standin_server" in a or "sglang::" in a or "sglang_router" in a or "smg::" in a
                   or "smg.launch_router" in a for a in p.cmdline)
            or p.comm.startswith(("sglang::", "smg::"))]


