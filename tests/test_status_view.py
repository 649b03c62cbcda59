"""`gpusupctl status` as text: what an operator reads first when something went wrong."""

from __future__ import annotations

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
