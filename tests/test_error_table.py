"""The table of our errors (errors.py): each has one D-Bus name and one exit code, the daemon
answers with the name, the client maps the name back to the class, and gpusupctl exits with the
class's code. Also gpusupctl's decisions before anything is queued: an unknown profile is named,
systemd's start limit is named as the cause. All offline: fakes for the bus and for systemd
(the real bus: test_dbus.py)."""

from __future__ import annotations

import asyncio
import inspect
import json
from types import SimpleNamespace

import pytest

from supervisord_gpu import errors
from supervisord_gpu.errors import (ERROR_PREFIX, ERRORS, Busy, ConfigError, OperationFailed, PermissionDenied,
                                    StartLimitHit, SupervisorError, UnitNotFound, UnknownProcess, error_for_name)

gi = pytest.importorskip("gi")
from gi.repository import Gio, GLib  # noqa: E402

from supervisord_gpu.api.client import InstanceClient  # noqa: E402
from supervisord_gpu.api.exports import export  # noqa: E402
from supervisord_gpu.bus import errors as bus_errors  # noqa: E402
from supervisord_gpu.cli import gpusupctl  # noqa: E402

#: the promise of the table, written out: what each error exits with (the README's exit codes)
EXIT_CODES = {
    "ConfigError": 2, "UsageError": 2, "UnknownProcess": 2, "UnknownJob": 2, "ArgumentTooLong": 2,
    "PreconditionError": 3, "Busy": 3, "StartLimitHit": 3, "UnitNotFound": 3, "ParkRefused": 3,
    "BusError": 4, "TakeoverFailed": 5, "GaveUp": 6,
    "StartError": 1, "OwnershipError": 1, "OperationFailed": 1, "PermissionDenied": 1,
}


def remote(name: str, text: str) -> GLib.Error:
    """What GLib raises for a remote error the daemon answered with (the real gi machinery)."""
    return Gio.DBusError.new_for_dbus_error(name, text)


# --------------------------------------------------------------------------- the table


def test_every_error_of_the_table_has_its_exit_code():
    assert {cls.__name__: cls.exit_code for cls in ERRORS} == EXIT_CODES


def test_every_error_has_a_d_bus_name_of_its_own_under_our_prefix():
    names = [cls.dbus_name for cls in ERRORS]
    assert len(set(names)) == len(names), names
    assert all(n.startswith(ERROR_PREFIX) and n.count(".") == ERROR_PREFIX.count(".") for n in names), names
    assert PermissionDenied.dbus_name == ERROR_PREFIX + "AccessDenied"  # what callers have always read


def test_no_error_class_of_errors_py_is_left_out_of_the_table():
    defined = {cls for _n, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, SupervisorError) and cls.__module__ == errors.__name__ and cls is not SupervisorError}
    assert defined == set(ERRORS)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_a_name_maps_back_to_its_class_and_a_rebuilt_error_keeps_the_text(cls):
    assert error_for_name(cls.dbus_name) is cls
    rebuilt = cls.from_message("what the daemon said")
    assert type(rebuilt) is cls and str(rebuilt) == "what the daemon said" and rebuilt.exit_code == EXIT_CODES[cls.__name__]


def test_names_not_in_the_table_map_to_nothing():
    for name in (None, "", "org.freedesktop.DBus.Error.AccessDenied", ERROR_PREFIX + "NoSuchThing",
                 "org.supervisordgpu.Error.busy"):
        assert error_for_name(name) is None


def test_unit_not_found_is_ours_not_the_builtin_lookup_error():
    assert not issubclass(UnitNotFound, LookupError)


# --------------------------------------------------------------------------- the daemon's side


class Obj:
    """An exported object the way api/service.py writes one."""

    def authorize(self, _context, _method):  # type: ignore[no-untyped-def]
        raise PermissionDenied("Poke needs root")

    @export("s", "s")
    def Get(self, name: str, dbus_context=None) -> str:  # type: ignore[no-untyped-def]
        raise UnknownProcess(f"no process {name!r}")

    @export("", "s")
    def Ping(self) -> str:
        raise Busy("busy with job 7")

    @export("", "s", control=True)
    def Poke(self, dbus_context=None) -> str:  # type: ignore[no-untyped-def]
        return "poked"


@pytest.mark.parametrize("call,cls", [
    (lambda o: o.Get("nope"), UnknownProcess), (lambda o: o.Ping(), Busy), (lambda o: o.Poke(), PermissionDenied),
    (lambda o: o.Get("x" * 1000), errors.ArgumentTooLong),
])
def test_an_exported_method_answers_with_the_errors_d_bus_name(call, cls):
    """pydbus answers with type(exception).__name__ (its registration.py): that is the name."""
    with pytest.raises(cls) as info:
        call(Obj())
    assert type(info.value).__name__ == cls.dbus_name
    assert info.value.exit_code == cls.exit_code and str(info.value)


def test_the_refusal_log_filter_drops_our_answers_and_keeps_bugs():
    import logging

    from supervisord_gpu.api.service import _Refusals

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("pydbus.registration", logging.ERROR, "", 0, "x", None, (type(exc), exc, None))

    assert not _Refusals().filter(record(bus_errors.on_the_wire(Busy("busy"))))
    assert _Refusals().filter(record(ValueError("a bug of ours")))


# --------------------------------------------------------------------------- the client's side


class Answering:
    """A connection whose every call fails with one GLib.Error (what the daemon answered)."""

    def __init__(self, error: GLib.Error) -> None:
        self.error = error

    def call_sync(self, *_args):  # type: ignore[no-untyped-def]
        raise self.error


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_the_client_raises_the_daemons_error_as_its_class_with_its_first_line(cls):
    client = InstanceClient(Answering(remote(cls.dbus_name, "pd said no\nand more below")), "pd")
    with pytest.raises(cls) as info:
        client.call("RestartProcess", "s", ("decode",))
    assert type(info.value) is cls and str(info.value) == "pd said no"
    assert info.value.exit_code == EXIT_CODES[cls.__name__]


def test_the_client_reads_the_name_never_the_text():
    said = "Busy: UnknownProcess AccessDenied"
    with pytest.raises(OperationFailed) as info:
        InstanceClient(Answering(remote("org.freedesktop.DBus.Error.Failed", said)), "pd").call("Ping")
    assert type(info.value) is OperationFailed and info.value.name == "org.freedesktop.DBus.Error.Failed"
    with pytest.raises(PermissionDenied):
        InstanceClient(Answering(remote("org.freedesktop.DBus.Error.AccessDenied", "x")), "pd").call("Stop")
    with pytest.raises(errors.BusError) as gone:
        InstanceClient(Answering(remote("org.freedesktop.DBus.Error.ServiceUnknown", "x")), "pd").call("Ping")
    assert gone.value.exit_code == 4


def test_gpusupctl_restart_process_exits_with_the_daemons_code(monkeypatch, capsys):
    monkeypatch.setattr("supervisord_gpu.systemd.manager.connect", lambda: Answering(
        remote(UnknownProcess.dbus_name, "instance pd has no process 'nope'")))
    assert gpusupctl.main(["restart", "pd", "--process", "nope"]) == 2
    assert capsys.readouterr().err == "gpusupctl: instance pd has no process 'nope'\n"
    monkeypatch.setattr("supervisord_gpu.systemd.manager.connect", lambda: Answering(
        remote(Busy.dbus_name, "pd is busy with job 4 (restart); try again when it is done")))
    assert gpusupctl.main(["restart", "pd", "--process", "decode", "--wait"]) == 3
    assert capsys.readouterr().err.startswith("gpusupctl: pd is busy with job 4")


class Jobs:
    """A daemon that accepts RestartProcess and then answers GetJob from a script of states."""

    def __init__(self, *ends: dict) -> None:  # type: ignore[type-arg]
        self.ends = list(ends)

    def call_sync(self, _name, _path, _iface, method, params, *_rest):  # type: ignore[no-untyped-def]
        if method == "RestartProcess":
            body = {"id": 9, "verb": f"restart {params.unpack()[0]}", "state": "running", "reason": "", "exit_code": None}
        else:
            body = self.ends.pop(0) if len(self.ends) > 1 else self.ends[0]
        return GLib.Variant("(s)", (json.dumps(body),))

    def signal_subscribe(self, *_args):  # type: ignore[no-untyped-def]
        return 1

    def signal_unsubscribe(self, _sub):  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("end,code,said", [
    ({"id": 9, "state": "done", "reason": "decode restarted", "exit_code": 0}, 0, "pd: decode restarted"),
    ({"id": 9, "state": "refused", "reason": "pd is starting, not ready", "exit_code": 3}, 3, "refused: pd is starting"),
    ({"id": 9, "state": "failed", "reason": "decode is failed: exited 1", "exit_code": 1}, 1, "failed: decode is failed"),
])
def test_restart_process_wait_follows_the_job_to_its_end_and_exits_with_its_code(monkeypatch, capsys, end, code, said):
    running = {"id": 9, "state": "running", "reason": "", "exit_code": None}
    monkeypatch.setattr("supervisord_gpu.systemd.manager.connect", lambda: Jobs(running, running, end))
    monkeypatch.setattr("supervisord_gpu.api.client.JOB_POLL_S", 0.001)
    assert gpusupctl.main(["restart", "pd", "--process", "decode", "--wait"]) == code
    out = capsys.readouterr()
    assert said in out.out + out.err


def test_restart_process_without_wait_says_the_accepted_job(monkeypatch, capsys):
    monkeypatch.setattr("supervisord_gpu.systemd.manager.connect", lambda: Jobs({"state": "running"}))
    assert gpusupctl.main(["restart", "pd", "--process", "decode"]) == 0
    assert "accepted as job 9" in capsys.readouterr().out


# --------------------------------------------------------------------------- the controller's answers


def bare_controller(**attrs):  # type: ignore[no-untyped-def]
    """An InstanceController with only what submit/request_stop/stop read (no instance, no loop)."""
    from supervisord_gpu.controller.controller import InstanceController

    c = object.__new__(InstanceController)
    c.profile = SimpleNamespace(name="pd")
    c.jobs = {}
    c._stop_job = None
    c._restarting = None
    c.stop_requested = asyncio.Event()
    for k, v in attrs.items():
        setattr(c, k, v)
    return c


def test_a_second_job_while_one_runs_is_refused_as_busy_naming_the_job():
    from supervisord_gpu.controller.outcome import Job

    c = bare_controller()
    running = c._keep(Job("restart decode"))
    with pytest.raises(Busy, match=f"pd is busy with job {running.id} \\(restart decode\\)") as info:
        c.submit("restart", lambda: None)
    assert info.value.exit_code == 3 and list(c.jobs) == [running.id]


def test_stop_is_a_job_that_ends_done_once_every_process_has_stopped():
    async def instance_stop(_why):  # type: ignore[no-untyped-def]
        return 0.5

    async def scenario() -> None:
        c = bare_controller(instance=SimpleNamespace(stop=instance_stop), _verb=asyncio.Lock())
        job = c.request_stop()
        assert c.stop_requested.is_set() and job.verb == "stop" and job.state == "running"
        assert c.request_stop() is job and c.jobs[job.id] is job  # asked twice: the same job, and GetJob finds it
        await c.stop()
        assert job.to_json()["state"] == "done" and job.to_json()["exit_code"] == 0 and job.reason == "stopped in 0.5 s"

    asyncio.run(scenario())


# --------------------------------------------------------------------------- gpusupctl before anything is queued


@pytest.fixture
def config_dir(tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "profiles").mkdir()
    for name in ("tp4-512k", "pd-1p1d"):
        (tmp_path / "profiles" / f"{name}.toml").write_text("")
    return tmp_path


@pytest.fixture
def queued(monkeypatch):  # type: ignore[no-untyped-def]
    """What would have been asked of systemd: nothing, where a test expects a refusal."""
    calls: list[tuple] = []  # type: ignore[type-arg]
    monkeypatch.setattr(gpusupctl, "_run_unit_job", lambda *a: calls.append(a) or 0)
    return calls


@pytest.mark.parametrize("verb", ["start", "restart"])
def test_a_typo_of_a_profile_is_named_unknown_with_a_did_you_mean_and_nothing_is_queued(verb, config_dir, queued, capsys):
    assert gpusupctl.main([verb, "tp4_512k", "--config-dir", str(config_dir)]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'tp4_512k'; did you mean 'tp4-512k'?" in err and "nothing was started" in err, err
    assert err.count("\n") == 1 and queued == []


def test_a_known_profile_is_queued_without_its_content_being_read(config_dir, queued, monkeypatch):
    """A gpusup member may start a profile it cannot read: only its existence is looked at
    (the tests run as root, whom modes do not stop, so no open() at all is the check)."""
    import builtins

    real_open = builtins.open

    def no_profile_opened(path, *a, **kw):  # type: ignore[no-untyped-def]
        assert "profiles" not in str(path), f"{path} was opened"
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", no_profile_opened)
    monkeypatch.setenv("SUPERVISORD_GPU_CONFIG_DIR", str(config_dir))
    assert gpusupctl.main(["start", "tp4-512k"]) == 0
    assert queued == [("start", "tp4-512k", False, 900.0)]


def test_a_stop_needs_no_profile(queued):
    assert gpusupctl.main(["stop", "gone-profile"]) == 0 and queued == [("stop", "gone-profile", False, 900.0)]


class FakeSystemd:
    """systemd as gpusupctl reads it: one unit, its properties, and what was asked of it."""

    def __init__(self, active: str = "active", result: str = "start-limit-hit", reset_refused: bool = False) -> None:
        self.props = {"ActiveState": active, "Result": result, "StartLimitBurst": 20,
                      "StartLimitIntervalUSec": 600_000_000, "StatusText": "stopped: stop requested"}
        self.reset_refused = reset_refused
        self.asked: list[str] = []

    def __call__(self) -> FakeSystemd:  # stands in for the class: Systemd() is this one
        return self

    def unit_path(self, _unit):  # type: ignore[no-untyped-def]
        return "/org/freedesktop/systemd1/unit/x"

    def active_state(self, _unit):  # type: ignore[no-untyped-def]
        return self.props["ActiveState"]

    def get(self, _path, _iface, prop):  # type: ignore[no-untyped-def]
        return self.props[prop]

    def reset_failed_unit(self, unit):  # type: ignore[no-untyped-def]
        self.asked.append("reset-failed")
        if self.reset_refused:
            raise PermissionDenied("ResetFailedUnit of dsv4@pd.service refused: Interactive authentication required.")

    def queue(self, method, unit):  # type: ignore[no-untyped-def]
        self.asked.append(method)
        return "/job/1"


def test_a_restart_refused_by_systemds_start_limit_names_that_cause_not_the_stop_before_it(monkeypatch, capsys):
    systemd = FakeSystemd()
    monkeypatch.setattr("supervisord_gpu.systemd.manager.Systemd", systemd)
    monkeypatch.setattr("supervisord_gpu.api.client.follow", lambda *a: ("failed", "failed"))
    monkeypatch.setattr(gpusupctl, "_check_profile_known", lambda *a: None)
    assert gpusupctl.main(["restart", "pd", "--wait"]) == StartLimitHit.exit_code == 3
    err = capsys.readouterr().err
    assert "its start limit was hit (20 starts within 600 s" in err and "stop requested" not in err, err
    assert "`gpusupctl start pd` resets the limit" in err


def test_a_failed_restart_for_any_other_reason_still_says_the_daemons_last_words(monkeypatch, capsys):
    monkeypatch.setattr("supervisord_gpu.systemd.manager.Systemd", FakeSystemd(result="exit-code"))
    monkeypatch.setattr("supervisord_gpu.api.client.follow", lambda *a: ("failed", "failed"))
    monkeypatch.setattr(gpusupctl, "_check_profile_known", lambda *a: None)
    assert gpusupctl.main(["restart", "pd", "--wait"]) == 1
    assert "job failed): stopped: stop requested" in capsys.readouterr().out


def test_a_start_limit_that_cannot_be_reset_refuses_before_queuing_and_says_who_can(monkeypatch, capsys):
    systemd = FakeSystemd(active="failed", reset_refused=True)
    monkeypatch.setattr("supervisord_gpu.systemd.manager.Systemd", systemd)
    monkeypatch.setattr(gpusupctl, "_check_profile_known", lambda *a: None)
    assert gpusupctl.main(["start", "pd"]) == 3
    err = capsys.readouterr().err
    assert "resetting it was refused" in err and "systemctl reset-failed dsv4@pd.service" in err, err
    assert systemd.asked == ["reset-failed"]  # nothing queued


def test_a_failed_unit_for_another_reason_is_still_started_when_its_reset_is_refused(monkeypatch, capsys):
    systemd = FakeSystemd(active="failed", result="exit-code", reset_refused=True)
    monkeypatch.setattr("supervisord_gpu.systemd.manager.Systemd", systemd)
    monkeypatch.setattr(gpusupctl, "_check_profile_known", lambda *a: None)
    assert gpusupctl.main(["start", "pd"]) == 0
    assert "stays failed" in capsys.readouterr().err and systemd.asked == ["reset-failed", "StartUnit"]


def test_config_error_rebuilt_from_a_message_has_its_fields():
    e = ConfigError.from_message("/etc/x.toml: servers: bad")
    assert isinstance(e, ConfigError) and e.problem == "/etc/x.toml: servers: bad" and e.exit_code == 2
