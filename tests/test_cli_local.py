"""gpusupctl's local verbs: `check` says what the daemon will say, a rehearsal is seen by every
other command and leaves nothing behind. (The systemd verbs: test_controller_systemd.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import free_ports, pd_profile, wait_for
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.controller.preflight import validate
from supervisord_gpu.daemon import backends_for
from supervisord_gpu.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

ONE_SERVER = """
[servers.server]
gpus = [0]
port = 31001
model_path = "/"
[servers.server.options]
{option}
"""


@pytest.mark.parametrize("option,expected", [
    ("tp = 4", "servers.server.options: rejected by"),  # an abbreviation SGLang's parser would take for --tp-size
    ("no-such-flag = 1", "servers.server.options: rejected by"),
])
def test_check_refuses_exactly_what_the_daemon_refuses(tmp_path, capsys, option, expected):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "supervisord-gpu.toml").write_text('[daemon]\ndefault_user = "root"\n')
    (tmp_path / "profiles" / "p.toml").write_text(ONE_SERVER.format(option=option))
    assert gpusupctl.main(["check", "p", "--config-dir", str(tmp_path)]) == 2
    said = capsys.readouterr().err.strip()
    cfg = load_daemon_config(str(tmp_path))
    with pytest.raises(ConfigError) as daemon_says:  # what the daemon runs before touching anything
        validate(load_profile(cfg, "p"), cfg, backends_for(cfg))
    assert said == f"gpusupctl: {daemon_says.value}" and expected in said, said


def rehearse_config_dir(tmp_path: Path, cgroups, profile: str, rehearsal: str, user: str = "root") -> Path:  # type: ignore[no-untyped-def]
    """A config dir for `gpusupctl rehearse pd`: rehearsal is not enabled in it, since `rehearse`
    switches it on in a directory of its own; `rehearsal` is the body of its [rehearsal] table."""
    cdir = tmp_path / "etc"
    (cdir / "profiles").mkdir(parents=True)
    (cdir / "supervisord-gpu.toml").write_text(textwrap.dedent(f"""
        [daemon]
        ownership = "cgroupfs"
        cgroup_root = "{cgroups.root}"
        runtime_dir = "{tmp_path / 'run'}"
        default_user = "{user}"
        [rehearsal]
        """) + rehearsal + "\n")
    (cdir / "profiles" / "pd.toml").write_text(textwrap.dedent(profile))
    return cdir


def test_a_running_rehearsal_is_seen_by_other_commands_and_leaves_nothing_behind(tmp_path, cgroups):
    cdir = rehearse_config_dir(tmp_path, cgroups, pd_profile(free_ports(5)), "server_startup = 0.5\nserver_mib_per_gpu = 1000")
    before = set(Path("/tmp").glob("supervisord-gpu-rehearsal*"))
    ctl = [sys.executable, "-m", "supervisord_gpu.cli.gpusupctl"]
    rehearsal = subprocess.Popen([*ctl, "rehearse", "pd", "--hold", "--config-dir", str(cdir)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any(line.startswith("POST ") for line in lines):
            assert time.monotonic() < deadline and rehearsal.poll() is None, "".join(lines)
            lines.append(rehearsal.stdout.readline())  # type: ignore[union-attr]
        seen = json.loads(subprocess.run([*ctl, "gpus", "--rehearsal", "--json", "--config-dir", str(cdir)], cwd=REPO,
                                         capture_output=True, text=True, check=True).stdout)
        held = {g["index"]: g for g in seen["gpus"]}
        assert seen["backend"] == "simulated" and held[0]["used_mib"] >= 1000 and held[1]["used_mib"] >= 1000, seen
        assert any("pd/prefill" in h for h in held[0]["holders"]), held[0]
        check = subprocess.run([*ctl, "check", "pd", "--rehearsal", "--config-dir", str(cdir)], cwd=REPO,
                               capture_output=True, text=True)
        assert check.returncode == 3 and "GPU 0" in check.stdout, check.stdout + check.stderr  # held: by the rehearsal
    finally:
        os.killpg(rehearsal.pid, signal.SIGINT)
        out, _ = rehearsal.communicate(timeout=60)
    assert rehearsal.returncode == 0, out
    assert "verified after stop: GPUs [0, 1] idle" in out, out
    left = sorted(p.name for p in (tmp_path / "run" / "rehearsal").iterdir())
    assert left in ([], ["cache"]), left
    assert set(Path("/tmp").glob("supervisord-gpu-rehearsal*")) == before


@pytest.mark.parametrize("how", ["the package's /etc/supervisord-gpu", "SUPERVISORD_GPU_CONFIG_DIR"])
def test_rehearse_runs_with_the_config_found_as_an_admin_finds_it(tmp_path, cgroups, how):
    """`gpusupctl rehearse NAME` as the README has it after installing: no --config-dir. It was
    "internal error: TypeError: expected str, bytes or os.PathLike object, not NoneType"."""
    from package_etc import GPUSUPCTL, available, run_as_installed

    cdir = rehearse_config_dir(tmp_path, cgroups, pd_profile(free_ports(5)), "server_startup = 0.3")
    if how == "SUPERVISORD_GPU_CONFIG_DIR":
        r = subprocess.run([*GPUSUPCTL, "rehearse", "pd"], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "SUPERVISORD_GPU_CONFIG_DIR": str(cdir)})
    else:
        if available() is not None:
            pytest.skip(available())
        r = run_as_installed(cdir, [*GPUSUPCTL, "rehearse", "pd"], timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "verified after stop: GPUs [0, 1] idle" in out, out
    assert "internal error" not in out, out


def test_a_failed_rehearsal_leaves_nothing_behind_either(tmp_path, cgroups):
    profile = pd_profile(free_ports(5), prefill_extra='[servers.prefill.env]\nSUPERVISORD_GPU_STANDIN_FAULT = "crash-on-start"\n')
    cdir = rehearse_config_dir(tmp_path, cgroups, profile, "server_startup = 0.2")
    r = subprocess.run([sys.executable, "-m", "supervisord_gpu.cli.gpusupctl", "rehearse", "pd", "--config-dir", str(cdir)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "prefill" in r.stdout + r.stderr, r.stdout + r.stderr
    # SGLang's own traceback is quoted in the reason; none of ours ever is
    assert "internal error" not in r.stderr and not any(l.startswith("Traceback") for l in (r.stdout + r.stderr).splitlines())
    wait_for(lambda: sorted(p.name for p in (tmp_path / "run" / "rehearsal").iterdir()) in ([], ["cache"]), 5, "cleanup")


@pytest.mark.parametrize("router_user", [None, "daemon"], ids=["router-as-the-servers", "router-of-its-own"])
def test_a_rehearsal_runs_its_servers_as_a_user_who_cannot_enter_the_checkout(tmp_path, cgroups, router_user):
    """#26: a checkout in /root (0700) and servers run as `sglang` (here: nobody). The checkout
    is this one, bound under a 0700 directory in a mount namespace of the test's own; the
    config and runtime directories lie under pytest's 0700 temp root. Before rehearsal/reach.py
    the first stand-in died: PermissionError: '.../.venv/bin/python3'. #37: the shipped profiles
    run the router as `sglang-router` (here: daemon, another account): it reaches the checkout too."""
    closed = tmp_path / "root"
    (closed / "supervisord-gpu").mkdir(parents=True)
    closed.chmod(0o700)
    checkout = closed / "supervisord-gpu"
    router_extra = f'user = "{router_user}"' if router_user else ""
    cdir = rehearse_config_dir(tmp_path, cgroups, pd_profile(free_ports(5), router_extra=router_extra),
                               "server_startup = 0.3", user="nobody")
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    router = ["setpriv", f"--reuid={router_user or 'nobody'}", "--regid=nogroup", "--clear-groups", "--"]
    script = (f"mount --bind {REPO} {checkout} && cd {checkout} && "
              f"if {' '.join(nobody)} test -x {checkout}/.venv/bin/python3; then echo 'nobody enters the checkout: the test proves nothing'; exit 9; fi; "
              f"if {' '.join(router)} test -x {checkout}/.venv/bin/python3; then echo 'the router enters the checkout: the test proves nothing'; exit 9; fi; "
              f"exec {checkout}/.venv/bin/python3 -m supervisord_gpu.cli.gpusupctl rehearse pd --config-dir {cdir}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "passed through in a mount namespace" in out and "verified after stop: GPUs [0, 1] idle" in out, out
    assert "PermissionError" not in out, out
    assert not any(checkout.iterdir()), "the bind outlived the test's namespace"
    # the sample generation through the router, whole (it was cut at 120 bytes, mid-number)
    post = next(line for line in r.stdout.splitlines() if line.startswith("POST "))
    answer = json.loads(post.split(" -> 200 ", 1)[1])
    assert answer["text"] and answer["meta_info"]["completion_tokens"] == 8, post


def test_a_checkout_closed_to_the_servers_user_itself_is_one_line_exit_2(tmp_path, cgroups):
    """The tmpfs cannot open a path that is itself 0700: say so, start nothing."""
    from supervisord_gpu.errors import UsageError
    from supervisord_gpu.rehearsal.reach import plan

    closed = tmp_path / "co"
    closed.mkdir()
    closed.chmod(0o700)
    with pytest.raises(UsageError, match=rf"rehearsal: {closed} is not readable by nobody.*chmod o\+rx {closed}"):
        plan([closed], ["nobody"])
    assert plan([closed], ["root"]) == {}  # root passes anything: nothing to do
    opened = tmp_path / "open"
    opened.mkdir(mode=0o755)
    opened.chmod(0o755)
    top = next(a for a in reversed(opened.parents) if not a.stat().st_mode & 0o001)  # pytest's 0700 temp root
    assert plan([opened, opened / ".", tmp_path / "open"], ["nobody"]) == {top: [opened]}


def test_reach_runs_a_command_where_nobody_reaches_a_dir_under_a_closed_one(tmp_path):
    """What `make test` wraps its pytest in (a checkout in /root): the command sees the dir at
    its own path, passes the closed ancestor, and sees nothing else of it."""
    if os.geteuid() != 0:
        pytest.skip("only root may enter a mount namespace and mount")
    opened = tmp_path / "closed" / "open"
    opened.mkdir(parents=True)
    (tmp_path / "closed").chmod(0o700)
    opened.chmod(0o755)
    (opened / "code.py").write_text("print('reached')\n")
    (tmp_path / "closed" / "secret").write_text("root's\n")
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    probe = [*nobody, "sh", "-c", f"cat {opened}/code.py; cat {tmp_path}/closed/secret 2>/dev/null || echo 'no secret'; "
             f"touch {tmp_path}/closed/planted 2>/dev/null && echo planted; true"]
    plain = subprocess.run(probe, capture_output=True, text=True)
    assert "reached" not in plain.stdout, "nobody reached it anyway: the test proves nothing"
    reach = [sys.executable, "-m", "supervisord_gpu.rehearsal.reach", "nobody", str(opened), "--"]
    # under umask 000: the dirs reach makes on its tmpfs are 0711 still, nobody plants nothing there
    r = subprocess.run([*reach, *probe], capture_output=True, text=True, cwd=REPO, preexec_fn=lambda: os.umask(0))
    assert r.returncode == 0 and r.stdout.split() == ["print('reached')", "no", "secret"], r.stdout + r.stderr
    assert "passed through for nobody" in r.stderr, r.stderr
    assert (tmp_path / "closed" / "secret").exists()  # the host's view is untouched
    bad = subprocess.run([*reach[:-1]], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("usage:"), bad.stderr
    missing = subprocess.run([*reach, "no-such-command"], capture_output=True, text=True, cwd=REPO)
    assert missing.returncode == 2 and missing.stderr.strip() == "reach: no-such-command: command not found", missing.stderr
    stranger = subprocess.run([*reach[:3], "no-such-user,nobody", *reach[4:], "true"], capture_output=True, text=True, cwd=REPO)
    assert stranger.returncode == 0 and "reach: no such user: no-such-user (skipped)" in stranger.stderr, stranger.stderr


def test_the_agents_sigterm_sets_stopping_even_inside_its_wait() -> None:
    """The agent's SIGTERM handler runs in the main thread, maybe while it holds the event's
    lock inside stopping.wait(); setting the event right there deadlocked (SIGALRM ends the
    test then). The relay thread sets it once the main thread lets the lock go."""
    import threading

    from supervisord_gpu.cli.daemon import set_on_signal

    stopping = threading.Event()
    previous = signal.getsignal(signal.SIGUSR1)

    def timeout(*_: object) -> None:
        raise TimeoutError("the handler waited on the lock its own thread holds")

    old_alarm = signal.signal(signal.SIGALRM, timeout)
    try:
        set_on_signal(stopping, signal.SIGUSR1)
        signal.alarm(3)
        with stopping._cond:  # type: ignore[attr-defined]  # where event.wait() holds it
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)  # the handler runs here, in this thread, lock held
            assert not stopping.is_set()
        assert stopping.wait(2), "SIGUSR1 never set the event"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGUSR1, previous)
