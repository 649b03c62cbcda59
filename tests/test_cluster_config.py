"""Profiles that span nodes: where each process runs, each node's part, and the errors of a careless profile."""

from __future__ import annotations

import textwrap

import pytest

from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.config.render import render
from supervisord_gpu.errors import ConfigError
from supervisord_gpu.records import replace

NODES = """
[nodes.a]
address = "10.9.0.1"
[nodes.b]
address = "10.9.0.2"
"""

PD_ACROSS = NODES + """
[servers.prefill]
node = "a"
role = "prefill"
host = "0.0.0.0"
gpus = [0, 1]
port = 31000
model_path = "/m"
[servers.decode]
node = "b"
role = "decode"
host = "0.0.0.0"
gpus = [0, 1]
port = 31001
model_path = "/m"
[router]
node = "a"
mode = "pd"
port = 31002
[router.options]
prometheus-port = 31009
"""

TP_SPANNING = NODES + """
[servers.big]
nodes = ["a", "b"]
dist_init_port = 31100
host = "0.0.0.0"
gpus = [0, 1, 2, 3]
port = 31000
model_path = "/m"
[servers.big.options]
tp-size = 8
[router]
node = "a"
port = 31001
[router.options]
prometheus-port = 31009
"""


def config_dir(tmp_path, profile: str, node: str = "a"):  # type: ignore[no-untyped-def]
    (tmp_path / "profiles").mkdir(parents=True, exist_ok=True)
    (tmp_path / "supervisord-gpu.toml").write_text(f'[daemon]\ndefault_user = "root"\n[cluster]\nnode = "{node}"\n')
    (tmp_path / "profiles" / "p.toml").write_text(textwrap.dedent(profile))
    return load_daemon_config(tmp_path)


def test_each_node_runs_only_its_own_part_and_the_router_reaches_the_other_node(tmp_path):
    on_a = load_profile(config_dir(tmp_path, PD_ACROSS, "a"), "p")
    assert [p.name for p in on_a.processes] == ["prefill", "router"] and on_a.node == "a"
    assert on_a.stop_order == ("router", "prefill")
    router = next(launch for launch in render(on_a, config_dir(tmp_path, PD_ACROSS, "a")) if launch.spec.name == "router")
    argv = list(router.argv)
    assert argv[argv.index("--decode") + 1] == "http://10.9.0.2:31001", argv  # decode is on b
    assert argv[argv.index("--prefill") + 1] == "http://10.9.0.1:31000", argv
    assert on_a.process("router").after == ("prefill",)
    assert on_a.process("router").peers_before_start == ("b/decode",)  # waited for in etcd, not locally
    assert on_a.process("prefill").peers_before_stop == ("b/decode",)  # router -> decode -> prefill across nodes
    on_b = load_profile(config_dir(tmp_path, PD_ACROSS, "b"), "p")
    assert [p.name for p in on_b.processes] == ["decode"] and on_b.gpus == frozenset({0, 1})
    assert on_b.process("decode").peers_before_stop == ("a/router",) and on_b.process("decode").peers_before_start == ()


def test_a_server_spanning_nodes_gets_one_rank_per_node_with_http_on_rank_0(tmp_path):
    cfg_a, cfg_b = config_dir(tmp_path / "a", TP_SPANNING, "a"), config_dir(tmp_path / "b", TP_SPANNING, "b")
    rank0 = next(x for x in render(load_profile(cfg_a, "p"), cfg_a) if x.spec.name == "big")
    rank1 = next(x for x in render(load_profile(cfg_b, "p"), cfg_b) if x.spec.name == "big")
    for launch, rank in ((rank0, "0"), (rank1, "1")):
        argv = list(launch.argv)
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == rank, argv
        assert argv[argv.index("--dist-init-addr") + 1] == "10.9.0.1:31100", argv  # rank 0's node, on every rank
        assert dict(launch.env)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert {(x.host, x.port) for x in rank0.spec.listens()} == {("0.0.0.0", 31000), ("0.0.0.0", 31100)}
    assert {(x.host, x.port) for x in rank1.spec.listens()} == {("0.0.0.0", 31000)}  # SGLang's dummy /health
    assert not rank1.spec.serves_http and rank1.spec.probe.liveness_path == "/health"  # its /ready is a 404
    assert [p.name for p in load_profile(cfg_b, "p").processes] == ["big"]  # the router is a's


def test_dp_attention_across_nodes_has_its_dist_init_ports_checked_on_every_node(tmp_path):
    """SGLang 0.5.23 with dp-attention across nodes also binds dist-init +1..+6 and +13 on each node."""
    dp = TP_SPANNING.replace("tp-size = 8", "tp-size = 8\nenable-dp-attention = true\ndp-size = 2")
    extra = {31100 + off for off in (1, 2, 3, 4, 5, 6, 13)}
    for node in ("a", "b"):
        cfg = config_dir(tmp_path / node, dp, node)
        spec = load_profile(cfg, "p").process("big")
        assert extra <= {x.port for x in spec.listens()}, node
    taken = dp.replace("port = 31001", "port = 31113")  # the router on a, on dist-init + 13
    config_dir(tmp_path / "c", taken)
    with pytest.raises(ConfigError, match="31113"):
        load_profile(load_daemon_config(tmp_path / "c"), "p")


@pytest.mark.parametrize("profile, key, words", [
    (PD_ACROSS.replace('node = "b"\n', ""), "servers.decode.node", "is required"),
    (PD_ACROSS.replace('node = "b"', 'node = "c"'), "servers.decode.node", "no node named 'c' in [nodes] (a, b)"),
    (PD_ACROSS.replace('host = "0.0.0.0"\ngpus = [0, 1]\nport = 31001', 'gpus = [0, 1]\nport = 31001'),
     "servers.decode.host", "127.0.0.1 cannot be reached from node 'a' (router)"),
    (PD_ACROSS.replace('role = "prefill"\nhost = "0.0.0.0"', 'role = "prefill"'),
     "servers.prefill.host", "cannot be reached from node 'b' (servers.decode)"),
    (TP_SPANNING.replace("tp-size = 8", "tp-size = 16"), "servers.big.gpus", "need 8 on each of 2 nodes"),
    (TP_SPANNING.replace("tp-size = 8", "tp-size = 7"), "servers.big.nodes", "cannot share evenly"),
    (TP_SPANNING.replace('nodes = ["a", "b"]', 'nodes = ["a", "a"]'), "servers.big.nodes", "two or more different"),
    (TP_SPANNING.replace("dist_init_port = 31100\n", ""), "servers.big.dist_init_port", "is required"),
    (TP_SPANNING.replace("dist_init_port = 31100", "dist_init_port = 25000"), "servers.big.dist_init_port",
     "random NCCL port range"),
    (TP_SPANNING.replace("[servers.big.options]", "[servers.big.options]\nnode-rank = 1"),
     "servers.big.options.node-rank", "is set by the profile key 'nodes'"),
    (TP_SPANNING.replace("[servers.big.options]", '[servers.big.options]\nnccl-init-addr = "10.9.0.9:1"'),
     "servers.big.options.nccl-init-addr", "is set by the profile key 'dist_init_port'"),
    (TP_SPANNING + '[servers.small]\nnode = "b"\ngpus = [3]\nport = 31003\nmodel_path = "/m"\n',
     "servers.small.gpus", "GPU 3 on node 'b' is also used by servers.big"),
    (NODES.replace('"10.9.0.2"', '"127.0.0.1"') + PD_ACROSS[len(NODES):], "nodes.b.address", "must be an address"),
    (PD_ACROSS[len(NODES):].replace('node = "b"', 'node = "a"'), "servers.prefill.node", "add a [nodes] table"),
])
def test_a_careless_cluster_profile_is_one_line_naming_file_and_key(tmp_path, capsys, profile, key, words):
    config_dir(tmp_path, profile)
    assert gpusupctl.main(["check", "p", "--config-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"p.toml: {key}: " in err and words in err, err


def test_the_same_port_on_two_nodes_is_not_a_conflict(tmp_path):
    same = PD_ACROSS.replace("port = 31001", "port = 31000")  # decode on b takes prefill's port number on a
    assert load_profile(config_dir(tmp_path, same, "b"), "p").process("decode").port == 31000


def test_a_node_the_profile_does_not_use_is_told_so(tmp_path):
    cfg = config_dir(tmp_path, PD_ACROSS, "c")
    with pytest.raises(ConfigError, match="this node is 'c', which the profile does not name"):
        load_profile(cfg, "p")
    whole = load_profile(cfg, "p", whole=True)
    assert [(p.name, p.node) for p in whole.processes] == [("prefill", "a"), ("decode", "b"), ("router", "a")]
    assert whole.stop_order == ("router", "decode", "prefill")  # the cluster-wide order, across nodes


def test_a_single_machine_profile_is_unchanged_and_needs_no_cluster(tmp_path):
    cfg = load_daemon_config("etc/supervisord-gpu")
    for name in ("pd-1p1d", "tp4-512k"):
        profile = load_profile(cfg, name)
        assert not profile.is_cluster and profile.remote == () and all(p.node is None for p in profile.processes)
        # rendered as this test's own user: the shipped profiles' "sglang" exists only where the package is
        as_me = replace(profile, processes=tuple(replace(p, user=None) for p in profile.processes))
        assert all("--nnodes" not in launch.argv for launch in render(as_me, cfg))


def test_a_cluster_profile_without_etcd_is_refused_naming_the_daemon_config_key(tmp_path, capsys):
    config_dir(tmp_path, PD_ACROSS)
    assert gpusupctl.main(["check", "p", "--config-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    first, *rest = err.splitlines()  # then check's other findings (the model path /m), one line each
    assert "supervisord-gpu.toml: cluster.etcd: is required: profile p spans nodes" in first, err
    assert all(line.startswith("gpusupctl: ") and "Traceback" not in line for line in rest), err


@pytest.mark.parametrize("cluster, key, words", [
    ('etcd = ["10.0.0.1:2379"]', "cluster.etcd[0]", 'must be an etcd URL like "https://10.0.0.1:2379"'),
    ('etcd = ["https://10.0.0.1\\u0000:2379"]', "cluster.etcd[0]", "must be an etcd URL like"),
    ('node = "Node_A"', "cluster.node", "must be a host name label"),
    ("lease_ttl = 1", "cluster.lease_ttl", ""),
    ('prefix = "no-slash"', "cluster.prefix", "must be a key path"),
    ("etcd_url = 1", "cluster.etcd_url", ""),
])
def test_a_bad_cluster_table_is_one_line_naming_its_key(tmp_path, capsys, cluster, key, words):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "supervisord-gpu.toml").write_text(f'[daemon]\ndefault_user = "root"\n[cluster]\n{cluster}\n')
    (tmp_path / "profiles" / "p.toml").write_text(textwrap.dedent(PD_ACROSS))
    assert gpusupctl.main(["check", "p", "--config-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"supervisord-gpu.toml: {key}: " in err and words in err and len(err.splitlines()) == 1, err
