"""`gpusupctl status` as text: what an operator reads first when something went wrong."""

from __future__ import annotations

import re

import pytest

from supervisord_gpu.cli.status_view import render

REASON = ("failed: prefill: scheduler failed; restart 5/5 within 600 s: restart limit reached, "
          "the instance gave up (exit 6); gpusupctl start dsv4@pd-1p1d to try again")


def _data(serving: bool = True, state: str = "failed") -> dict:  # type: ignore[type-arg]
    process = {"name": "prefill", "role": "prefill", "pid": 4711, "port": 30100, "gpus": [0, 1], "phase": "serving",
               "phase_elapsed_s": 5.0, "restarts": 5, "state": "ready", "serving": serving,
               "last_error": "RuntimeError: " + "x" * 120 + " END"}
    return {"at": 100.0, "gpus": None, "gpu_backend": "", "notes": [], "instances": [{
        "unit": "dsv4@pd-1p1d.service", "active_state": state, "sub_state": "", "since": 50.0, "result": "exit-code",
        "status_text": REASON, "last_status_text": "",
        "daemon": {"state": state, "reason": REASON, "processes": [process]}}]}


def test_the_reason_is_never_cut_however_long():
    text = render(_data(), colour=False)
    joined = " ".join(line.strip() for line in text.splitlines())
    assert "restart limit reached" in joined and "to try again (result: exit-code)" in joined
    assert all(len(line) <= 80 for line in text.splitlines() if "RuntimeError" not in line and "x" * 10 not in line)


def test_a_ready_server_that_sglang_says_is_not_serving_is_marked_so():
    assert "not serving (paused, latched by a failed /health, or draining)" in render(_data(serving=False), colour=False)
    assert "not serving" not in render(_data(serving=True), colour=False)


ANSI = re.compile(r"\033\[[0-9;]*m")


def _gpus(data: dict) -> dict:  # type: ignore[type-arg]
    held = [{"pid": 4242, "owner": None, "description": "x"}]
    data["gpus"] = [{"index": 0, "name": "H200", "used_mib": 0, "total_mib": 143771, "idle": True, "holders": []},
                    {"index": 1, "name": "H200", "used_mib": 90000, "total_mib": 143771, "idle": False, "holders": held}]
    return data


@pytest.mark.parametrize("state", ["failed", "ready"])
def test_colours_take_no_columns(state):
    """Painted or not, a person sees the same columns: `failed` keeps its spacing, `yes` is
    not glued to what follows."""
    plain = render(_gpus(_data(state=state)), colour=False, width=100)
    painted = render(_gpus(_data(state=state)), colour=True, width=100)
    assert "\033[" in painted and ANSI.sub("", painted) == plain
    assert f"{'dsv4@pd-1p1d.service':<28} {state:<10}  since 50s" in plain
    assert f"0   {'0/143771 MiB':<22}yes   -" in plain and f"1   {'90000/143771 MiB':<22}no    pid 4242 (foreign)" in plain


def test_the_reason_wraps_at_the_terminals_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # what shutil.get_terminal_size reads first, as a terminal would set it
    wide = render(_data(), colour=False).splitlines()
    assert max(len(line) for line in wide if "x" * 10 not in line) > 100, wide
    assert all(len(line) <= 160 for line in wide)
    monkeypatch.setenv("COLUMNS", "80")
    narrow = render(_data(), colour=False).splitlines()
    assert len(narrow) > len(wide) and all(len(line) <= 80 for line in narrow if "x" * 10 not in line)
