"""The test set-up's install (tests/rig/install_quietly.sh) leaves no unit enabled that it enabled (#26).

Debian's postinsts enable what a package ships, and the packages' Recommends bring more units
than any list names; on a host without systemd as PID 1 (CI's) deb-systemd-helper refused to
disable them outside dpkg, so etcd and prometheus stayed enabled. Here the script runs against
a root directory of its own (`systemctl --root`, the real systemctl) with an apt-get that does
only what those postinsts do: enable each package's unit, alias included. What the machine had
enabled before must stay so; policy-rc.d forbids starts during the install only.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "rig" / "install_quietly.sh"

pytestmark = pytest.mark.skipif(shutil.which("systemctl") is None, reason="needs systemctl (offline use only)")

#: apt-get as the postinsts of the packages named behave: each ships NAME.service, wanted by
#: multi-user.target with an alias, and enables it; it notes whether policy-rc.d was in place
FAKE_APT = """#!/bin/sh
[ "$1" = update ] && exit 0
[ -e "$INSTALL_ROOT/usr/sbin/policy-rc.d" ] && echo present > "$INSTALL_ROOT/policy-during-install"
for pkg in "$@"; do
    case "$pkg" in install|-*) continue ;; esac
    printf '[Service]\\nExecStart=/bin/true\\n[Install]\\nWantedBy=multi-user.target\\nAlias=%s-alias.service\\n' "$pkg" \\
        > "$INSTALL_ROOT/lib/systemd/system/$pkg.service"
    systemctl --root="$INSTALL_ROOT" enable "$pkg.service" >/dev/null 2>&1 || exit 100
done
"""


def machine(tmp_path: Path) -> Path:
    """A root directory with one unit the machine had enabled before the install."""
    root = tmp_path / "root"
    for d in ("lib/systemd/system", "etc/systemd/system", "usr/sbin"):
        (root / d).mkdir(parents=True)
    (root / "lib/systemd/system/theirs.service").write_text(
        "[Service]\nExecStart=/bin/true\n[Install]\nWantedBy=multi-user.target\n")
    subprocess.run(["systemctl", f"--root={root}", "enable", "theirs.service"], check=True, capture_output=True)
    return root


def install(tmp_path: Path, root: Path, *packages: str, apt_text: str = FAKE_APT) -> subprocess.CompletedProcess[str]:
    apt = tmp_path / "apt-get"
    apt.write_text(apt_text)
    apt.chmod(0o755)
    env = {**os.environ, "INSTALL_ROOT": str(root), "APT_GET": str(apt)}
    return subprocess.run(["sh", str(SCRIPT), *packages], env=env, capture_output=True, text=True, timeout=60)


def links(root: Path) -> set[str]:
    units = root / "etc/systemd/system"
    return {str(p.relative_to(units)) for p in units.rglob("*") if p.is_symlink()}


def test_every_unit_the_install_enabled_is_disabled_and_the_machines_own_stay(tmp_path: Path) -> None:
    root = machine(tmp_path)
    had = links(root)
    done = install(tmp_path, root, "etcd-server", "prometheus")
    assert done.returncode == 0, done.stderr
    assert (root / "policy-during-install").read_text() == "present\n"  # no starts while installing
    assert not (root / "usr/sbin/policy-rc.d").exists()  # and ours is gone again
    assert links(root) == had == {"multi-user.target.wants/theirs.service"}, done.stderr
    assert (root / "lib/systemd/system/etcd-server.service").exists()  # installed, only not enabled


def test_a_policy_rc_d_the_machine_had_is_left_as_it_was(tmp_path: Path) -> None:
    root = machine(tmp_path)
    theirs = root / "usr/sbin/policy-rc.d"
    theirs.write_text("#!/bin/sh\nexit 0\n")
    done = install(tmp_path, root, "etcd-server")
    assert done.returncode == 0, done.stderr
    assert theirs.read_text() == "#!/bin/sh\nexit 0\n"
    assert links(root) == {"multi-user.target.wants/theirs.service"}


def test_a_failed_install_is_its_exit_status_and_still_leaves_nothing_enabled(tmp_path: Path) -> None:
    """dpkg failing after a postinst enabled its unit (a later package's error)."""
    root = machine(tmp_path)
    done = install(tmp_path, root, "prometheus", apt_text=FAKE_APT + "exit 100\n")
    assert done.returncode == 100, done.stderr
    assert links(root) == {"multi-user.target.wants/theirs.service"}, done.stderr


def test_an_apt_holding_its_lock_is_waited_for_not_a_failure(tmp_path: Path) -> None:
    """`make deb` while another apt runs (unattended-upgrades on a fresh machine) failed at once:
    `apt-get update` does not wait for the lists' lock. It is retried until the lock is free;
    apt-get install is told to wait for dpkg's (DPkg::Lock::Timeout)."""
    root = machine(tmp_path)
    busy = tmp_path / "busy-twice"
    busy.write_text("2")
    holder = f"""#!/bin/sh
if [ "$1" = update ]; then
    n=$(cat {busy}); [ "$n" -gt 0 ] || exit 0
    echo $((n - 1)) > {busy}
    echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)" >&2; exit 100
fi
echo "$@" > {tmp_path}/install-args
exit 0
"""
    done = install(tmp_path, root, "prometheus", apt_text=holder)
    assert done.returncode == 0, done.stderr
    assert "another apt holds its lock; waiting for it" in done.stderr and busy.read_text().strip() == "0"
    assert "-oDPkg::Lock::Timeout=600" in (tmp_path / "install-args").read_text().split()
    busy.write_text("99")
    apt = tmp_path / "apt-get"
    env = {**os.environ, "INSTALL_ROOT": str(root), "APT_GET": str(apt), "APT_LOCK_WAIT": "2"}
    gave_up = subprocess.run(["sh", str(SCRIPT), "prometheus"], env=env, capture_output=True, text=True, timeout=60)
    assert gave_up.returncode != 0 and "still holds its lock after 2 s" in gave_up.stderr, gave_up.stderr
    offline = "#!/bin/sh\n[ \"$1\" = update ] && { echo 'E: Failed to fetch' >&2; exit 100; }\nexit 0\n"
    failed = install(tmp_path, root, "prometheus", apt_text=offline)
    assert failed.returncode != 0 and "waiting" not in failed.stderr, failed.stderr  # no lock: not retried


def _default_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_install_still_removes_policy_rc_d_and_disables_what_was_enabled(tmp_path: Path, signum: int) -> None:
    """A SIGTERM or SIGHUP while apt ran (a closed ssh session, a killed `make`) left our
    policy-rc.d ("exit 101") on the host: from then on no package install started its service.
    The script now waits for apt, puts the host back, and ends with the signal's status."""
    root = machine(tmp_path)
    started, release = tmp_path / "apt-started", tmp_path / "apt-release"
    # apt runs until the test has sent its signal (a fixed sleep lost the race on a loaded machine:
    # the install had ended, exit 0, before the signal came)
    slow = FAKE_APT + f"echo > {started}\nfor i in $(seq 100); do [ -e {release} ] && break; sleep 0.1; done\n"
    apt = tmp_path / "apt-get"
    apt.write_text(slow)
    apt.chmod(0o755)
    env = {**os.environ, "INSTALL_ROOT": str(root), "APT_GET": str(apt)}
    # the signals' default dispositions: a test run started with `nohup` or `&` hands its children
    # SIGHUP or SIGINT ignored, which a shell cannot trap (POSIX), and the install then ran to exit 0
    script = subprocess.Popen(["sh", str(SCRIPT), "etcd-server"], env=env, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_default_signals)
    deadline = time.monotonic() + 30
    while not started.exists() and script.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started.exists(), "the fake apt never ran"
    script.send_signal(signum)
    time.sleep(0.1)
    release.touch()
    _, err = script.communicate(timeout=30)
    time.sleep(0.6)  # an orphaned apt (the old script died at once) has finished by now
    assert script.returncode == 128 + signum, err
    assert not (root / "usr/sbin/policy-rc.d").exists(), "policy-rc.d left on the host"
    assert links(root) == {"multi-user.target.wants/theirs.service"}, err
