"""The cluster-wide step order of a switch, computed from whole profiles, before anything runs.

A switch across nodes is the single-machine takeover spread over machines: stop what is in the
way, then let every node of the new profile verify, by its own NVML and socket table, that its
GPUs are idle and its ports free, then start the new profile. Each step is carried out by the
nodes' agents on their own units (`dsv4@NAME` on every node of it, at once); no step begins
before every node has reported the one before done.

Inside a step the processes keep the profile's own order *across nodes* -- router -> decode ->
prefill to stop, servers (every rank of a spanning server at once: rank 0 waits for the others
at its rendezvous) -> router to start -- because each node's daemon waits in etcd for the other
nodes' processes before each of its own (cluster/gate.py). `order` says it for people.

Pure data in, pure data out: the coordinator writes the plan to etcd, the per-node agents read
their share of each step, and `gpusupctl switch --dry-run` prints it.
"""

from __future__ import annotations

from typing import Literal

from ..config.cluster import nodes_of
from ..config.model import ProcessSpec, Profile
from ..records import asdict, dataclass

Action = Literal["stop", "verify", "start"]


@dataclass(frozen=True)
class NodeWork:
    node: str
    instance: str
    processes: tuple[str, ...]  # for verify: ()


@dataclass(frozen=True)
class Step:
    number: int
    action: Action
    work: tuple[NodeWork, ...]
    #: the processes' cluster-wide order inside the step: "router@a -> decode@b -> prefill@a"
    order: str = ""

    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.node for w in self.work))

    def describe(self) -> str:
        instance = self.work[0].instance if self.work else "?"
        nodes = ", ".join(self.nodes())
        what = {"stop": f"stop dsv4@{instance} on {nodes}",
                "verify": f"verify on {nodes}: GPUs idle (NVML) and ports free, each node by itself",
                "start": f"start dsv4@{instance} on {nodes}"}[self.action]
        return f"{self.number}. {what}" + (f"\n     order: {self.order}" if self.order else "")


@dataclass(frozen=True)
class ClusterPlan:
    target: str
    stopping: tuple[str, ...]
    steps: tuple[Step, ...]

    def to_json(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        head = f"plan: switch the cluster to {self.target}" + (
            f" from {', '.join(self.stopping)}" if self.stopping else " (nothing to stop)")
        return "\n".join([head, *("  " + s.describe() for s in self.steps)])


def _placed(spec: ProcessSpec) -> tuple[str, ...]:
    return tuple(n for n in nodes_of(spec) if n is not None)


def _held(profile: Profile) -> set[tuple[str, str, int]]:
    """(node, "gpu"|"port", number) for everything a profile takes, rank by rank."""
    out: set[tuple[str, str, int]] = set()
    for spec in profile.processes:
        for node in _placed(spec):
            out.update((node, "gpu", g) for g in spec.gpus)
        for listen in spec.listens():
            out.add((spec.node or "", "port", listen.port))
    return out


def conflicts(target: Profile, running: list[Profile]) -> list[Profile]:
    """The running cluster profiles that hold a GPU or a port of `target` on some node."""
    want = _held(target)
    return [p for p in running if p.name != target.name and _held(p) & want]


def plan_switch(target: Profile, running: list[Profile]) -> ClusterPlan:
    """Every step of a switch to `target` (whole, not a node's part) from the `running` ones."""
    steps: list[Step] = []

    def add(action: Action, work: list[NodeWork], order: str = "") -> None:
        if work:
            steps.append(Step(len(steps) + 1, action, tuple(work), order))

    in_the_way = conflicts(target, running)
    for old in in_the_way:
        add("stop", _whole(old), _describe(stop_sequence(old)))
    add("verify", [NodeWork(w.node, target.name, ()) for w in _whole(target)])
    add("start", _whole(target), _describe(start_sequence(target)))
    return ClusterPlan(target.name, tuple(p.name for p in in_the_way), tuple(steps))


def stop_sequence(profile: Profile) -> list[list[NodeWork]]:
    """The stop waves across nodes: router -> decode -> prefill, each wave's work per node."""
    return [_per_node(profile, wave) for wave in profile.stop_waves]


def start_sequence(profile: Profile) -> list[list[NodeWork]]:
    return [_per_node(profile, wave) for wave in _start_waves(profile)]


def _whole(profile: Profile) -> list[NodeWork]:
    """Every node's part of `profile`, as one unit each."""
    return _per_node(profile, tuple(s.name for s in profile.processes))


def _describe(waves: list[list[NodeWork]]) -> str:
    return " -> ".join(" + ".join(f"{p}@{w.node}" for w in wave for p in w.processes) for wave in waves)


def _per_node(profile: Profile, names: tuple[str, ...]) -> list[NodeWork]:
    by_node: dict[str, list[str]] = {}
    for name in names:
        for node in _placed(profile.process(name)):  # every rank of a spanning server, on its node
            by_node.setdefault(node, []).append(name)
    order = [n for n, _ in profile.nodes]
    return [NodeWork(n, profile.name, tuple(by_node[n])) for n in sorted(by_node, key=order.index)]


def _start_waves(profile: Profile) -> list[tuple[str, ...]]:
    """The start order cut where a process waits for one before it (`after`, which the router
    has on every server it fronts): everything in a wave can start at once."""
    waves: list[list[str]] = []
    placed: dict[str, int] = {}
    for spec in profile.processes:  # already in a valid start order
        wave = max((placed[a] + 1 for a in spec.after if a in placed), default=0)
        while len(waves) <= wave:
            waves.append([])
        waves[wave].append(spec.name)
        placed[spec.name] = wave
    return [tuple(w) for w in waves]
