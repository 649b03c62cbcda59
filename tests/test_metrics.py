"""The Prometheus endpoint: what a scrape shows through a start, a restart and a stop; the dashboard.

The scenario runs once per module: a rehearsed PD profile (stand-in prefill and decode on
simulated GPUs 0 and 1, the router) with its exporter serving on a free port, scraped before
the start, once ready, after an operator restart of decode, and after the stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import types
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.model import MetricsConfig
from supervisord_gpu.config.render import render
from supervisord_gpu.engine.instance import Instance
from supervisord_gpu.metrics import MetricsExporter, MetricsUnavailable, reason_codes
from supervisord_gpu.daemon import backends_for
from support import CgroupSandbox, free_ports, make_instance, pd_profile, write_config

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "etc/grafana/supervisord-gpu-dashboard.json"
SCRAPE_EXAMPLE = ROOT / "etc/prometheus/prometheus-scrape-example.yml"


# ---------------------------------------------------------------------- reading a scrape


class Scrape:
    """One scrape's text, with its samples by name and labels."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no sample {name}{labels} in the scrape"
        return self.samples[key]

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def uuid_of(self, gpu: str) -> str:
        for labels in self.series("supervisord_gpu_gpu_memory_used_bytes"):
            if ("gpu", gpu) in labels:
                return dict(labels)["uuid"]
        raise AssertionError(f"no memory series for GPU {gpu}")

    def names(self) -> set[str]:
        """Every name a PromQL expression may use: samples, and the series a declared family will have."""
        names = {name for name, _ in self.samples}
        for line in self.text.splitlines():
            m = re.match(r"# TYPE (\S+) (\w+)", line)
            if m:
                base, kind = m.groups()
                names.add(base)
                if kind == "histogram":
                    names |= {base + "_bucket", base + "_sum", base + "_count"}
        return names


def changed(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return Scrape(resp.read().decode())


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing (Debian package: prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return exe


def promtool_check(text: str) -> None:
    result = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    problems = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not problems, f"promtool check metrics: {problems}"


def gpu_inventory(cfg):  # type: ignore[no-untyped-def]
    """The simulated GPUs of the rehearsal, read the way the daemon reads them."""
    from supervisord_gpu.checks.gpus import open_inventory

    return open_inventory("simulated", simgpu_dir=cfg.rehearsal.simgpu_dir, tolerance_mib=cfg.gpus.idle_tolerance_mib)


# ---------------------------------------------------------------------- the scenario


@dataclass
class Rehearsal:
    before: Scrape
    started: Scrape
    restarted: Scrape
    stopped: Scrape
    metrics_port: int


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):  # type: ignore[no-untyped-def]
    try:
        sandbox = CgroupSandbox()
    except RuntimeError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"needs a writable cgroup v2 (root): {e}")
    tmp = tmp_path_factory.mktemp("metrics")
    (metrics_port,) = free_ports(1)
    extra = f"[metrics]\nenabled = true\nhost = \"127.0.0.1\"\nport = {metrics_port}\n"
    cdir = write_config(tmp, {"pd": pd_profile(free_ports(5))}, sandbox.root, extra=extra)
    instance, cfg = make_instance(cdir, "pd")
    exporter = MetricsExporter(cfg.metrics, instance, gpu_inventory(cfg))
    exporter.start()
    instance.listeners.append(exporter.on_event)

    async def go() -> Rehearsal:
        exporter.watch_loop(asyncio.get_running_loop())
        before = await asyncio.to_thread(scrape, metrics_port)
        await instance.start()
        await asyncio.sleep(1.2)  # one loop-lag measurement
        started = await asyncio.to_thread(scrape, metrics_port)
        await instance.restart_process("decode")
        restarted = await asyncio.to_thread(scrape, metrics_port)
        await instance.stop()
        stopped = await asyncio.to_thread(scrape, metrics_port)
        return Rehearsal(before, started, restarted, stopped, metrics_port)

    try:
        yield asyncio.run(go())
    finally:
        exporter.stop()
        sandbox.destroy()


PROCESSES = {"prefill": "prefill", "decode": "decode", "router": "router"}  # name -> role


def test_before_the_start_the_instance_is_stopped_and_nothing_is_ready(rehearsal):
    s = rehearsal.before
    assert s.value("supervisord_gpu_up") == 1
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="stopped") == 1
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="ready") == 0
    for name, role in PROCESSES.items():
        assert s.value("supervisord_gpu_process_ready", profile="pd", process=name, role=role) == 0
        assert s.value("supervisord_gpu_process_restarts_total", profile="pd", process=name, role=role) == 0
        assert s.value("supervisord_gpu_stop_seconds_count", profile="pd", process=name) == 0
        assert s.value("supervisord_gpu_startup_phase_seconds_count", profile="pd", process=name, phase="total") == 0


def test_once_started_every_process_is_ready_and_the_start_was_timed(rehearsal):
    s = rehearsal.started
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="ready") == 1
    assert sum(s.series("supervisord_gpu_instance_state").values()) == 1
    for name, role in PROCESSES.items():
        assert s.value("supervisord_gpu_process_ready", profile="pd", process=name, role=role) == 1
        assert s.value("supervisord_gpu_process_state", profile="pd", process=name, role=role, state="ready") == 1
        assert s.value("supervisord_gpu_startup_phase_seconds_count", profile="pd", process=name, phase="total") == 1
    for server in ("prefill", "decode"):
        for phase in ("weights", "kv_cache", "cuda_graphs"):
            assert s.value("supervisord_gpu_startup_phase_seconds_count", profile="pd", process=server, phase=phase) == 1
    assert s.value("supervisord_gpu_instance_start_seconds_count", profile="pd") == 1
    assert s.value("supervisord_gpu_instance_start_seconds_sum", profile="pd") > 0
    assert changed(rehearsal.before, s, "supervisord_gpu_last_event_timestamp_seconds", profile="pd") > 0
    assert 0 <= s.value("supervisord_gpu_event_loop_lag_seconds") < 0.5


def test_gpu_memory_and_idleness_follow_the_servers(rehearsal):
    s = rehearsal.started
    assert s.value("supervisord_gpu_gpu_inventory_up") == 1, "the GPU inventory could not be read"
    uuid0, uuid2 = s.uuid_of("0"), s.uuid_of("2")
    assert s.value("supervisord_gpu_gpu_idle", gpu="0") == 0 and s.value("supervisord_gpu_gpu_idle", gpu="1") == 0
    assert s.value("supervisord_gpu_gpu_idle", gpu="2") == 1
    used0 = s.value("supervisord_gpu_gpu_memory_used_bytes", gpu="0", uuid=uuid0)
    assert used0 >= s.value("supervisord_gpu_gpu_memory_used_bytes", gpu="2", uuid=uuid2) + 1000 * 2**20
    assert s.value("supervisord_gpu_gpu_memory_total_bytes", gpu="0", uuid=uuid0) > used0
    assert rehearsal.stopped.value("supervisord_gpu_gpu_idle", gpu="0") == 1


def test_restarting_decode_counts_one_restart_and_one_stop_of_decode_only(rehearsal):
    a, b = rehearsal.started, rehearsal.restarted
    for name, role in PROCESSES.items():
        added = 1 if name == "decode" else 0
        labels = dict(profile="pd", process=name, role=role)
        assert changed(a, b, "supervisord_gpu_process_restarts_total", **labels) == added
        assert changed(a, b, "supervisord_gpu_stop_seconds_count", profile="pd", process=name) == added
        assert changed(a, b, "supervisord_gpu_startup_phase_seconds_count", profile="pd", process=name, phase="total") == added
        assert b.value("supervisord_gpu_process_ready", **labels) == 1
    assert b.value("supervisord_gpu_instance_state", profile="pd", state="ready") == 1
    assert changed(a, b, "supervisord_gpu_instance_start_seconds_count", profile="pd") == 0, "a restart is not an instance start"


def test_after_the_stop_the_instance_is_stopped_and_every_stop_was_timed(rehearsal):
    a, s = rehearsal.restarted, rehearsal.stopped
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="stopped") == 1
    assert sum(s.series("supervisord_gpu_instance_state").values()) == 1
    for name, role in PROCESSES.items():
        assert s.value("supervisord_gpu_process_ready", profile="pd", process=name, role=role) == 0
        assert s.value("supervisord_gpu_process_state", profile="pd", process=name, role=role, state="stopped") == 1
        assert changed(a, s, "supervisord_gpu_stop_seconds_count", profile="pd", process=name) == 1
    assert s.value("supervisord_gpu_instance_stop_seconds_count", profile="pd") == 1
    assert s.value("supervisord_gpu_instance_stop_seconds_sum", profile="pd") > 0


def test_every_scrape_passes_promtool_check_metrics(rehearsal):
    for name in ("before", "started", "restarted", "stopped"):
        promtool_check(getattr(rehearsal, name).text)


# ---------------------------------------------------------------------- the dashboard


def dashboard_panels() -> list[dict]:  # type: ignore[type-arg]
    data = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in data["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # panels of a collapsed row
    return panels


def test_the_dashboard_loads_with_a_datasource_variable():
    data = json.loads(DASHBOARD.read_text())
    assert data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard_panels():
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_dashboard_expression_names_only_metrics_the_supervisor_exports(rehearsal):
    exported = rehearsal.stopped.names()
    used: set[str] = set()
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            used |= set(re.findall(r"supervisord_gpu_[a-z_]+", target["expr"]))
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        used |= set(re.findall(r"supervisord_gpu_[a-z_]+", json.dumps(variable.get("query", ""))))
    assert used, "the dashboard queries no supervisor metric"
    assert sorted(used - exported) == []


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    grafana = {"$host": ".*", "$profile": ".*", "$__rate_interval": "1m", "$__range": "1h"}
    rules = []
    for i, panel in enumerate(dashboard_panels()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in grafana.items():
                expr = expr.replace(variable, value)
            rules.append({"record": f"dashboard:panel{i}:{target['refId']}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scrape_example_scrapes_the_supervisor_the_servers_and_the_router():
    text = SCRAPE_EXAMPLE.read_text()
    for target in ("127.0.0.1:9464", "127.0.0.1:30100", "127.0.0.1:30200", "127.0.0.1:30300", "127.0.0.1:30091",
                   "127.0.0.1:30092"):
        assert f"'{target}'" in text or f'"{target}"' in text or f"- {target}" in text, target
    result = subprocess.run([promtool(), "check", "config", "--syntax-only", str(SCRAPE_EXAMPLE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------- without a running instance


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def child_line(self, *args: object, **kwargs: object) -> None:
        pass

    def event(self, message: str, priority: int = 6, **fields: str) -> None:
        self.events.append((message, priority))


@pytest.fixture
def idle_instance(tmp_path):  # type: ignore[no-untyped-def]
    """The pd profile as an Instance that is never started (no cgroups needed)."""
    cdir = write_config(tmp_path, {"pd": pd_profile(free_ports(5))}, tmp_path / "cgroup")
    cfg = load_daemon_config(cdir)
    profile = load_profile(cfg, "pd")
    owner = types.SimpleNamespace(name="none")
    return Instance(profile, render(profile, cfg, backends_for(cfg).programs), owner, RecordingSink())  # type: ignore[arg-type]


def local_exporter(instance: Instance, inventory: object = None) -> tuple[MetricsExporter, int]:
    (port,) = free_ports(1)
    exporter = MetricsExporter(MetricsConfig(True, "127.0.0.1", port), instance, inventory)  # type: ignore[arg-type]
    return exporter, port


def test_refusals_are_counted_by_a_short_reason_code(idle_instance):
    exporter, port = local_exporter(idle_instance)
    exporter.start()
    try:
        exporter.precondition_failed("refusing to start: GPU 0 not idle: 80000 MiB held by pid 12 (python3 -m sglang.launch_server)")
        exporter.precondition_failed(
            "refusing to start: GPU 1 not idle: held by pid 12; 127.0.0.1:30001 (router) held by pid 77 (nginx: master)"
        )
        exporter.precondition_failed("/etc/supervisord-gpu/profiles/pd.toml: servers.decode.gpus[0]: GPU 9 does not exist")
        exporter.precondition_failed("refusing to start: dsv4@tp4-512k is running (takeover = false in the profile)")
        s = scrape(port)
    finally:
        exporter.stop()
    counts = {code: s.value("supervisord_gpu_precondition_failures_total", profile="pd", reason=code)
              for code in ("gpu_busy", "port_busy", "gpu_missing", "other")}
    assert counts == {"gpu_busy": 2, "port_busy": 1, "gpu_missing": 1, "other": 1}


def test_a_refusing_preflight_is_counted_and_still_refuses(idle_instance):
    from supervisord_gpu.errors import PreconditionError

    exporter, _ = local_exporter(idle_instance)

    async def refuse() -> None:
        raise PreconditionError("refusing to start: port 30001 in use by pid 5")

    with pytest.raises(PreconditionError):
        asyncio.run(exporter.counting_preflight(refuse)())
    s = Scrape(_exposition(exporter))
    assert s.value("supervisord_gpu_precondition_failures_total", profile="pd", reason="port_busy") == 1


def test_reason_codes_read_the_subject_of_each_problem():
    assert reason_codes("refusing to start: GPU 0 is not idle: used by pid 1 (sglang --port 30001)") == ["gpu_busy"]
    assert reason_codes("refusing to start: port 30001 (router) is in use by pid 2") == ["port_busy"]
    assert reason_codes("GPU 9 does not exist (this machine has 8 visible GPU(s))") == ["gpu_missing"]
    assert reason_codes("NVML: driver not loaded") == ["other"]


def test_transitions_are_timed_by_from_to_and_outcome_and_pass_promtool(idle_instance):
    exporter, _ = local_exporter(idle_instance)
    exporter.transition_observed(42.0, "tp4-512k", "pd", "ok")
    exporter.transition_observed(7.5, "pd", "tp4-512k", "rolled_back")
    text = _exposition(exporter)
    s = Scrape(text)
    assert s.value("supervisord_gpu_transition_seconds_count", **{"from": "tp4-512k", "to": "pd", "outcome": "ok"}) == 1
    assert s.value("supervisord_gpu_transition_seconds_sum", **{"from": "pd", "to": "tp4-512k", "outcome": "rolled_back"}) == 7.5
    promtool_check(text)


def test_a_failing_gpu_inventory_reports_itself_down_without_failing_the_scrape(idle_instance):
    class Broken:
        def snapshot(self) -> list[object]:
            raise RuntimeError("NVML gone")

    exporter, _ = local_exporter(idle_instance, Broken())
    text = _exposition(exporter)
    s = Scrape(text)
    assert s.value("supervisord_gpu_gpu_inventory_up") == 0
    assert s.value("supervisord_gpu_up") == 1
    assert "supervisord_gpu_gpu_memory_used_bytes" in s.names(), "the family stays declared, without samples"
    assert s.series("supervisord_gpu_gpu_memory_used_bytes") == {}
    promtool_check(text)


def test_state_gauges_follow_events_as_they_arrive(idle_instance):
    exporter, _ = local_exporter(idle_instance)
    idle_instance.listeners.append(exporter.on_event)
    idle_instance.fail("refusing to start: GPU 0 not idle")  # a refused start
    s = Scrape(_exposition(exporter))
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="failed") == 1
    assert s.value("supervisord_gpu_instance_state", profile="pd", state="stopped") == 0
    assert s.value("supervisord_gpu_instance_stop_seconds_count", profile="pd") == 0, "no stop happened"


def test_a_metrics_port_in_use_is_taken_once_it_is_free(idle_instance):
    import socket

    (port,) = free_ports(1)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    exporter = MetricsExporter(MetricsConfig(True, "127.0.0.1", port), idle_instance)
    try:
        exporter.start()
        assert not exporter.serving
        assert any("in use" in m and p == 4 for m, p in idle_instance.sink.events)
        squatter.close()
        assert asyncio.run(_wait_for(lambda: exporter.serving, 5.0)), "the exporter did not take the port once it was free"
        assert scrape(port).value("supervisord_gpu_up") == 1
    finally:
        squatter.close()
        exporter.stop()


def test_a_metrics_address_that_cannot_exist_is_one_clear_error(idle_instance):
    exporter = MetricsExporter(MetricsConfig(True, "192.0.2.1", free_ports(1)[0]), idle_instance)
    with pytest.raises(MetricsUnavailable, match=r"cannot serve metrics on 192\.0\.2\.1:\d+: .*\[metrics\] host/port"):
        exporter.start()
    exporter.stop()


def test_importing_the_metrics_module_does_not_load_prometheus_client():
    code = "import sys, supervisord_gpu.daemon, supervisord_gpu.metrics; print('prometheus_client' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"


def _exposition(exporter: MetricsExporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()


async def _wait_for(condition, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()

