"""Property-based bad input: whatever a profile or a command line holds, never a traceback.

A bad profile is exit 2 and one line that names the file (and, where there is one, the key);
nothing is started (render and check start nothing by construction, and the daemon's own
refusal is tested in test_config.py).
"""

from __future__ import annotations

import io
import os
import string
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisord_gpu.cli import gpusupctl

# CI runs a seeded subset (the same examples every time); GPUSUP_FUZZ_EXAMPLES=10000 is the run
# at scale, outside CI (its result is in bench/results/fuzz.json).
SCALE = int(os.environ.get("GPUSUP_FUZZ_EXAMPLES", "0"))
SEEDED = not SCALE


def examples(ci: int) -> int:
    return SCALE or ci

GOOD_LINES = """description = "fuzz"
takeover = true
[restart]
max_restarts = 3
[servers.prefill]
role = "prefill"
gpus = [0, 1]
port = 31000
model_path = "/m"
[servers.prefill.options]
tp-size = 2
context-length = "128k"
[servers.decode]
role = "decode"
gpus = [2, 3]
port = 31001
model_path = "/m"
after = ["prefill"]
[router]
mode = "pd"
port = 31002
[router.options]
policy = "round_robin"
prometheus-port = 31009
""".splitlines()

odd_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
scalar = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf").replace("nan", "nan")),
    st.booleans().map(lambda b: "true" if b else "false"),
    odd_text.map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'),
    st.just("[0, 0]"), st.just("[[1], [2]]"), st.just("{a = 1}"), st.just('["ghost"]'), st.just("[" * 40 + "]" * 40),
)
key = st.one_of(st.sampled_from(["gpus", "port", "role", "mode", "after", "tp-size", "user", "decode", "prefill",
                                 "start_timeout", "context-length", "host", "model_path", "workers"]),
                st.text(alphabet=string.ascii_letters + "-_.", min_size=1, max_size=10))


@st.composite
def mutated_profile(draw) -> bytes:  # type: ignore[no-untyped-def]
    lines = list(GOOD_LINES)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["replace", "delete", "insert", "bytes", "duplicate"]))
        i = draw(st.integers(0, len(lines) - 1))
        if op == "replace" and "=" in lines[i]:
            lines[i] = lines[i].split("=")[0] + "= " + draw(scalar)
        elif op == "delete":
            del lines[i]
            if not lines:
                lines = ["x = 1"]
        elif op == "insert":
            lines.insert(i, f"{draw(key)} = {draw(scalar)}")
        elif op == "duplicate":
            lines.insert(i, lines[i])
    data = "\n".join(lines).encode()
    if draw(st.booleans()) and draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.binary(min_size=1, max_size=4)) + data[cut:]
    return data


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = gpusupctl.main(argv)
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def config_dir():  # type: ignore[no-untyped-def]
    d = Path(tempfile.mkdtemp(prefix="gpusup-fuzz-"))
    (d / "profiles").mkdir()
    (d / "supervisord-gpu.toml").write_text("[daemon]\ndefault_user = \"root\"\n[rehearsal]\nsimgpu_dir = \"%s\"\n" % (d / "sim"))
    return d


@settings(max_examples=examples(300), deadline=None, derandomize=SEEDED,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=mutated_profile())
def test_any_profile_renders_or_is_one_line_exit_2(config_dir, data):
    path = config_dir / "profiles" / "p.toml"
    path.write_bytes(data)
    code, out, err = run_cli(["render", "p", "--config-dir", str(config_dir)])
    assert code in (0, 2), err
    assert "Traceback" not in err and "internal error" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gpusupctl: {path}: "), err
    else:
        assert "argv" in out


argv_item = st.one_of(st.sampled_from(["render", "check", "gpus", "--json", "--rehearsal", "--config-dir", "p", "nope",
                                       "--help", "-v", "--hold", "--from", "--dry-run"]), odd_text)


@settings(max_examples=examples(200), deadline=None, derandomize=SEEDED,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=st.lists(argv_item, max_size=5))
def test_any_command_line_is_an_exit_code_never_a_traceback(config_dir, argv):
    if argv and argv[0] not in ("render", "check", "gpus"):
        argv = ["render", *argv]  # keep to commands that touch nothing
    if "--config-dir" in argv:
        i = argv.index("--config-dir")
        argv = argv[:i] + argv[i + 1:]
    code, _out, err = run_cli([*argv, "--config-dir", str(config_dir)])
    assert code in (0, 1, 2, 3, 4)
    assert "Traceback" not in err and "internal error" not in err, err


instance_name = st.one_of(odd_text, st.text(alphabet=string.ascii_letters + string.digits + "._-@/\n\t ", max_size=70),
                          st.sampled_from(["tp4-512k\n", "../etc/passwd", "pd-1p1d.toml", "-x", "a" * 65, ".hidden", ""]))


@settings(max_examples=examples(200), deadline=None, derandomize=SEEDED,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=instance_name, verb=st.sampled_from(["render", "check", "switch", "status", "start", "stop", "restart"]))
def test_any_instance_name_is_refused_cleanly_or_names_a_profile(config_dir, name, verb):
    argv = [verb, name] if verb in ("status", "start", "stop", "restart") else [verb, name, "--config-dir", str(config_dir)]
    if verb == "switch":
        argv.append("--dry-run")
    saved = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = "unix:path=/nonexistent"  # a name that passes must reach no systemd
    try:
        code, _out, err = run_cli(argv)
    finally:
        if saved is None:
            del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
        else:
            os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = saved
    assert code in (0, 1, 2, 3, 4), (argv, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(err.strip().splitlines()) <= 2 or err.startswith("usage:"), err  # one line, or argparse's usage
