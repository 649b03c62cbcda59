"""etcd without TLS or login needs the operator's consent, and is said wherever it runs so (#37).

A local user's `curl` to an etcd without TLS and login made an agent stop the cluster profiles:
etcd is where orders for root come from. So a `[cluster]` that leaves etcd open is refused in one
line naming the daemon config's key, unless it says `insecure = true`; then every start of an
agent or a cluster part says so at warning priority, and `status --cluster` shows it.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from cluster_fixtures import FakeUnits, NoGpus, memory_store, node_config
from supervisord_gpu.cli import gpusupctl
from supervisord_gpu.cluster.agent import NodeAgent
from supervisord_gpu.cluster.kv import MemoryKV
from supervisord_gpu.cluster.store import ClusterStore
from supervisord_gpu.config.cluster import part
from supervisord_gpu.config.loader import load_daemon_config, load_profile
from supervisord_gpu.daemon import RunOptions, build_instance
from supervisord_gpu.records import replace

LOGIN = 'user = "gpusup"\npassword_file = "/etc/supervisord-gpu/etcd/password"\n'
TLS = ('cacert = "/etc/supervisord-gpu/etcd/ca.crt"\ncert = "/etc/supervisord-gpu/etcd/node.crt"\n'
       'key = "/etc/supervisord-gpu/etcd/node.key"\n')


def write_cluster(tmp_path, table: str):  # type: ignore[no-untyped-def]
    (tmp_path / "profiles").mkdir(exist_ok=True)
    (tmp_path / "supervisord-gpu.toml").write_text(f'[daemon]\ndefault_user = "root"\n[cluster]\nnode = "a"\n{table}')
    return tmp_path


@pytest.mark.parametrize("table, exposed", [
    ('etcd = ["http://10.0.0.3:2379"]\n', "no TLS (http://10.0.0.3:2379); no login"),
    ('etcd = ["https://10.0.0.3:2379"]\n' + TLS.split("\n")[0] + "\n", "no login (neither cert/key nor user/password_file)"),
    ('etcd = ["http://10.0.0.3:2379"]\n' + LOGIN, "no TLS (http://10.0.0.3:2379): whoever"),
])
def test_etcd_left_open_is_refused_in_one_line_naming_the_daemon_config_key(tmp_path, capsys, table, exposed):
    cdir = write_cluster(tmp_path, table)
    assert gpusupctl.main(["status", "--cluster", "--config-dir", str(cdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{cdir}/supervisord-gpu.toml: cluster.etcd: {exposed}" in err, err
    assert "insecure = true in [cluster]" in err, err


def test_etcd_with_tls_and_a_login_needs_no_consent_and_warns_of_nothing(tmp_path):
    from supervisord_gpu.config.cluster import insecure_warning

    c = load_daemon_config(write_cluster(tmp_path, 'etcd = ["https://10.0.0.3:2379"]\n' + TLS + LOGIN)).cluster
    assert not c.insecure and insecure_warning(c) is None


def test_insecure_true_is_the_consent_and_the_agent_says_it_at_warning_priority_on_every_start(tmp_path):
    cfg = node_config(tmp_path)  # http://127.0.0.1:9 with insecure = true
    assert cfg.cluster.insecure
    said: list[tuple[str, int]] = []
    for _start in range(2):
        agent = NodeAgent(cfg, memory_store(cfg), FakeUnits(), NoGpus(), lambda m, p: said.append((m, p)))  # type: ignore[arg-type]
        agent.stopping.set()
        assert agent.run() == 0
    warnings = [m for m, p in said if p == 4 and m.startswith("etcd is insecure by consent")]
    assert len(warnings) == 2, said
    assert "no TLS (http://127.0.0.1:9); no login" in warnings[0] and "[cluster] insecure = true" in warnings[0]


def test_a_secure_etcd_gives_the_agent_nothing_to_warn_of(tmp_path):
    cfg = node_config(tmp_path)
    secure = replace(cfg.cluster, etcd=("https://10.0.0.3:2379",), cert="/c", key="/k", insecure=False)
    cfg = replace(cfg, cluster=secure)
    said: list[tuple[str, int]] = []
    agent = NodeAgent(cfg, memory_store(cfg), FakeUnits(), NoGpus(), lambda m, p: said.append((m, p)))  # type: ignore[arg-type]
    agent.stopping.set()
    agent.run()
    assert not [m for m, p in said if p <= 4], said


def test_a_cluster_part_started_on_insecure_etcd_says_so_at_warning_priority(tmp_path, monkeypatch):
    cfg = node_config(tmp_path)
    profile = part(load_profile(cfg, "pd", whole=True), "a")
    events: list[tuple[str, int]] = []
    from supervisord_gpu.systemd import journal

    monkeypatch.setattr(journal.StderrSink, "event", lambda _self, m, p=6, **_f: events.append((m, p)))
    monkeypatch.setattr(ClusterStore, "_connect", staticmethod(lambda _cfg: MemoryKV()))
    build_instance(cfg, profile, RunOptions(force_stderr=True))
    assert any(p == 4 and m.startswith("etcd is insecure by consent") for m, p in events), events


def test_status_cluster_shows_the_consent(tmp_path, capsys, monkeypatch):
    node_config(tmp_path)
    monkeypatch.setattr(ClusterStore, "_connect", staticmethod(lambda _cfg: MemoryKV()))
    assert gpusupctl.main(["status", "--cluster", "--config-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("WARNING: etcd is insecure by consent"), out
    assert gpusupctl.main(["status", "--cluster", "--json", "--config-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["insecure"].startswith("etcd is insecure by consent"), shown


def test_the_consent_is_a_boolean(tmp_path, capsys):
    cdir = write_cluster(tmp_path, textwrap.dedent('etcd = ["http://10.0.0.3:2379"]\ninsecure = "yes"\n'))
    assert gpusupctl.main(["status", "--cluster", "--config-dir", str(cdir)]) == 2
    assert "cluster.insecure: " in capsys.readouterr().err
