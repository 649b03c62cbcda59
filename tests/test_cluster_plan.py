"""The cluster-wide step order of a switch: stops in the profile's order across nodes, a local
verification on every node of the new profile, then the new servers and the router last."""

from __future__ import annotations

import json
import textwrap

from supervisord_gpu.cluster.plan import ClusterPlan, conflicts, plan_switch, start_sequence, stop_sequence
from supervisord_gpu.cluster.records import parse_plan
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from test_cluster_config import PD_ACROSS, TP_SPANNING


def whole(tmp_path, **profiles: str):  # type: ignore[no-untyped-def]
    (tmp_path / "profiles").mkdir(parents=True, exist_ok=True)
    (tmp_path / "supervisord-gpu.toml").write_text('[daemon]\ndefault_user = "root"\n[cluster]\nnode = "a"\n')
    for name, text in profiles.items():
        (tmp_path / "profiles" / f"{name}.toml").write_text(textwrap.dedent(text))
    cfg = load_daemon_config(tmp_path)
    return {name: load_profile(cfg, name, whole=True) for name in profiles}


def steps(plan: ClusterPlan) -> list[tuple[str, list[tuple[str, tuple[str, ...]]]]]:
    return [(s.action, [(w.node, w.processes) for w in s.work]) for s in plan.steps]


def waves(sequence) -> list[list[tuple[str, tuple[str, ...]]]]:  # type: ignore[no-untyped-def]
    return [[(w.node, w.processes) for w in wave] for wave in sequence]


def test_pd_to_tp_across_nodes_stops_pd_on_both_nodes_verifies_each_then_starts_tp(tmp_path):
    p = whole(tmp_path, pd=PD_ACROSS, tp=TP_SPANNING)
    plan = plan_switch(p["tp"], [p["pd"]])
    assert plan.stopping == ("pd",)
    assert steps(plan) == [
        ("stop", [("a", ("prefill", "router")), ("b", ("decode",))]),
        ("verify", [("a", ()), ("b", ())]),
        ("start", [("a", ("big", "router")), ("b", ("big",))]),
    ]
    assert plan.steps[0].order == "router@a -> decode@b -> prefill@a"  # decode on b between a's router and prefill
    assert plan.steps[2].order == "big@a + big@b -> router@a"  # both ranks at once: rank 0 waits for rank 1
    assert "1. stop dsv4@pd on a, b\n     order: router@a -> decode@b -> prefill@a" in plan.render()


def test_the_order_inside_each_step_is_the_profiles_own_across_nodes(tmp_path):
    p = whole(tmp_path, pd=PD_ACROSS, tp=TP_SPANNING)
    assert waves(stop_sequence(p["pd"])) == [[("a", ("router",))], [("b", ("decode",))], [("a", ("prefill",))]]
    assert waves(stop_sequence(p["tp"])) == [[("a", ("router",))], [("a", ("big",)), ("b", ("big",))]]
    assert waves(start_sequence(p["pd"])) == [[("a", ("prefill",)), ("b", ("decode",))], [("a", ("router",))]]


def test_a_profile_on_other_gpus_and_ports_is_not_in_the_way_and_the_plan_survives_etcd(tmp_path):
    elsewhere = PD_ACROSS.replace("gpus = [0, 1]", "gpus = [6, 7]").replace("port = 3100", "port = 3200").replace(
        "prometheus-port = 31009", "prometheus-port = 32009")
    p = whole(tmp_path, pd=PD_ACROSS, tp=TP_SPANNING, other=elsewhere)
    assert conflicts(p["tp"], [p["other"]]) == [] and conflicts(p["tp"], [p["pd"], p["other"]]) == [p["pd"]]
    plan = plan_switch(p["tp"], [p["other"]])
    assert [s.action for s in plan.steps] == ["verify", "start"]
    again = parse_plan("plan", json.dumps(plan.to_json()))  # what the agents read back from the store
    assert again == plan
