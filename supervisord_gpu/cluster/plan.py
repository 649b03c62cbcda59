"""The cluster-wide step order of a switch, computed from whole profiles, before anything runs.

A switch across nodes is the single-machine takeover spread over machines: stop what is in the
way in the profile's own stop order (router -> decode -> prefill), *even when those processes
sit on different nodes*; then let every node of the new profile verify, by its own NVML and
socket table, that its GPUs are idle and its ports free; then start the new servers (every rank
of a server spanning nodes at once, since rank 0 waits for the others at its rendezvous), and
the router last. A step lists what each node does in it; the nodes of one step act in parallel,
and no step starts before every node has reported the one before done.

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

    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.node for w in self.work))

    def describe(self) -> str:
        parts = [f"{w.node}: {w.instance}" + (f" {'+'.join(w.processes)}" if w.processes else "") for w in self.work]
        what = {"stop": "stop", "verify": "verify GPUs idle and ports free on", "start": "start"}[self.action]
        return f"{self.number}. {what} " + "; ".join(parts)


@dataclass(frozen=True)
class ClusterPlan:
    target: str
    stopping: tuple[str, ...]
    steps: tuple[Step, ...]

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> ClusterPlan:
        steps = tuple(Step(s["number"], s["action"], tuple(NodeWork(w["node"], w["instance"], tuple(w["processes"]))
                                                               for w in s["work"])) for s in data["steps"])
        return ClusterPlan(data["target"], tuple(data["stopping"]), steps)

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

    def add(action: Action, work: list[NodeWork]) -> None:
        if work:
            steps.append(Step(len(steps) + 1, action, tuple(work)))

    in_the_way = conflicts(target, running)
    for old in in_the_way:
        for wave in old.stop_waves:  # the profile's own order, across nodes: router -> decode -> prefill
            add("stop", _per_node(old, wave))
    add("verify", [NodeWork(n, target.name, ()) for n, _address in target.nodes
                   if any(n in _placed(s) for s in target.processes)])
    for wave in _start_waves(target):
        add("start", _per_node(target, wave))
    return ClusterPlan(target.name, tuple(p.name for p in in_the_way), tuple(steps))


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
