"""Profiles that span nodes: which process runs where, and each node's part of the whole.

The same profile file sits on every node. A `[nodes]` table names the nodes and the address
the others reach each one at; every process then says where it runs (`node = "a"`), and a
server may span nodes (`nodes = ["a", "b"]`: one SGLang process per node, rank i on the i-th,
with `--nnodes`, `--node-rank` and `--dist-init-addr` rendered; HTTP on rank 0 only).
A node's daemon runs `part(profile, node)`: its own processes, with the others kept aside
for the router's command line. Without `[nodes]` nothing here applies and a profile is
exactly what it was on one machine.

Checks are the loader's promise: one line naming the file and key, before anything starts.
GPUs and ports collide only on the same node; a server another node talks to (the router's
workers, a prefill server its decode servers pull from) must not listen on loopback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..records import replace
from .model import ClusterConfig, ProcessSpec, Profile
from .tables import Table, type_name

NODE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")  # a hostname label
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_nodes(top: Table) -> tuple[tuple[str, str], ...]:
    """`[nodes.NAME] address = "..."`, in file order; () when the profile has no [nodes]."""
    if not top.has("nodes"):
        return ()
    t = top.table("nodes")
    out: list[tuple[str, str]] = []
    for name, data in t.items():
        if not NODE_NAME_RE.match(name):
            raise t.error(name, "a node name must be a host name label: lower-case letters, digits and '-'")
        n = Table(t.path, t.key(name), data)
        address = n.str("address")
        if not address or any(c.isspace() for c in address) or address in LOOPBACK:
            raise n.error("address", f"must be an address the other nodes reach this one at, not {address!r}")
        n.finish()
        out.append((name, address))
    if not out:
        raise ConfigError(t.path, "nodes", "must name at least one node (or remove [nodes] for a single machine)")
    return tuple(out)


def placement(t: Table, nodes: tuple[tuple[str, str], ...], server: bool) -> dict[str, Any]:
    """The cluster fields of one process's table (its ProcessSpec keywords); {} on one machine."""
    known = dict(nodes)
    if not nodes:
        for key in ("node", "nodes", "dist_init_port"):
            if t.has(key):
                raise t.error(key, "is for profiles that span machines: add a [nodes] table naming them")
        return {}

    def node_name(value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(t.path, key, f"must be a node name, not {type_name(value)}")
        if value not in known:
            raise ConfigError(t.path, key, f"no node named {value!r} in [nodes] ({', '.join(known)})")
        return value

    spans = t.list("nodes", node_name, None) if server else None
    if spans is not None:
        if t.has("node"):
            raise t.error("node", "a server has either node (one machine) or nodes (spanning machines), not both")
        if len(spans) < 2 or len(set(spans)) != len(spans):
            raise t.error("nodes", "must list two or more different nodes (for one node write node = \"...\")")
        port = t.port("dist_init_port")
        return {"node": spans[0], "nodes": tuple(spans), "address": known[spans[0]],
                "dist_init_port": port, "dist_init_host": known[spans[0]]}
    if not t.has("node"):
        raise t.error("node", f"is required: this profile spans nodes ({', '.join(known)}); say where this process runs")
    where = node_name(t.raw("node"), t.key("node"))
    if t.has("dist_init_port"):
        raise t.error("dist_init_port", "is for a server spanning nodes (nodes = [...])")
    return {"node": where, "address": known[where]}


def etcd_exposures(c: ClusterConfig) -> tuple[str, ...]:
    """What leaves etcd open to whoever reaches it: no TLS (a plain http:// endpoint: orders and
    a password readable and forgeable on the wire), no login (neither a client certificate nor a
    user: anyone who can connect writes). Either lets a stranger order this node's root agent."""
    out: list[str] = []
    plain = [e for e in c.etcd if e.startswith("http://")]
    if plain:
        out.append(f"no TLS ({', '.join(plain)})")
    if c.etcd and c.cert is None and c.user is None:
        out.append("no login (neither cert/key nor user/password_file)")
    return tuple(out)


def insecure_warning(c: ClusterConfig) -> str | None:
    """The line every start of an agent or a cluster part says at warning priority, and
    `status --cluster` shows, while etcd runs insecure by consent; None when it does not."""
    exposed = etcd_exposures(c)
    if not exposed:
        return None
    return (f"etcd is insecure by consent ([cluster] insecure = true in supervisord-gpu.toml): "
            f"{'; '.join(exposed)}; whoever reaches etcd can make this node's root agent stop and start units")


def nodes_of(spec: ProcessSpec) -> tuple[str | None, ...]:
    """Every node a process takes GPUs on: each rank's, for a server spanning nodes."""
    return spec.nodes or (spec.node,)


def check_parallelism_per_node(path: Path, spec: ProcessSpec, needed: int) -> None:
    """tp x pp over N nodes: SGLang puts needed / N ranks on each node, one GPU each."""
    n = len(spec.nodes)
    if needed % n:
        raise ConfigError(path, f"{spec.key}.nodes", f"the parallelism options need {needed} GPU(s), "
                                                     f"which {n} nodes cannot share evenly")
    if needed // n > len(spec.gpus):
        raise ConfigError(path, f"{spec.key}.gpus", f"lists {len(spec.gpus)} GPU(s) per node but the parallelism "
                                                    f"options need {needed // n} on each of {n} nodes")


def check_reachable(path: Path, specs: list[ProcessSpec]) -> None:
    """A server another node talks to must listen where that node can reach it."""
    by_name = {s.name: s for s in specs}
    for s in specs:
        if s.kind != "router":
            continue
        for name in s.workers + s.prefill + s.decode:
            _reachable_from(path, by_name[name], s)
        for p in s.prefill:
            for d in s.decode:  # a decode server pulls its KV cache from the prefill's bootstrap server
                _reachable_from(path, by_name[p], by_name[d])


def _reachable_from(path: Path, server: ProcessSpec, peer: ProcessSpec) -> None:
    if server.node != peer.node and server.host in LOOPBACK:
        raise ConfigError(path, f"{server.key}.host", f"{server.host} cannot be reached from node {peer.node!r} "
                                                      f"({peer.key}); set host = \"0.0.0.0\" or node "
                                                      f"{server.node!r}'s address {server.address}")


def peer_key(node: str, process: str) -> str:
    return f"{node}/{process}"


def _remote_start_deps(profile: Profile, spec: ProcessSpec, local: set[str]) -> tuple[str, ...]:
    """What `spec` waits for on other nodes: its `after` there (rank 0 answers for a spanning server)."""
    return tuple(peer_key(profile.process(a).node or "", a) for a in spec.after if a not in local)


def _remote_stop_deps(profile: Profile, spec: ProcessSpec, node: str) -> tuple[str, ...]:
    """Every rank on other nodes in the stop waves before `spec`'s: router -> decode -> prefill across nodes."""
    out: list[str] = []
    for wave in profile.stop_waves:
        if spec.name in wave:
            return tuple(out)
        for name in wave:
            out += [peer_key(n, name) for n in nodes_of(profile.process(name)) if n is not None and n != node]
    return tuple(out)


def part(profile: Profile, node: str) -> Profile:
    """What `node`'s daemon runs of a cluster profile: its processes in the profile's start and
    stop order, each rank of a spanning server as that node's own process; what it waits for on
    other nodes is the cluster's step order, not its own."""
    known = dict(profile.nodes)
    if node not in known:
        raise ConfigError(profile.path, "nodes", f"this node is {node!r}, which the profile does not name "
                                                 f"({', '.join(known)}); set [cluster] node in supervisord-gpu.toml")
    local: list[ProcessSpec] = []
    for spec in profile.processes:
        if node in spec.nodes and spec.nodes.index(node) > 0:
            # a rank > 0 has only SGLang's dummy health server: /health answers at once, /ready is a 404
            probe = replace(spec.probe, path="/health", liveness_path="/health", scheduler_path=None)
            local.append(replace(spec, node=node, node_rank=spec.nodes.index(node), address=known[node], probe=probe))
        elif spec.node == node:
            local.append(spec)
    if not local:
        raise ConfigError(profile.path, "nodes", f"no process of this profile runs on node {node!r} (this node)")
    names = {s.name for s in local}
    local = [replace(s, after=tuple(a for a in s.after if a in names),
                     peers_before_start=_remote_start_deps(profile, s, names),
                     peers_before_stop=_remote_stop_deps(profile, s, node)) for s in local]
    remote = tuple(s for s in profile.processes if s.name not in names)
    return replace(profile, processes=tuple(local), stop_order=tuple(n for n in profile.stop_order if n in names),
                   node=node, remote=remote)
