"""Servers that share a GPU: who may, how much of the card they take together, and who starts when.

Two SGLang servers fit on one card when each is told how much of it to take (its
`--mem-fraction-static`) and they start one after the other. SGLang sizes its static pool
(weights and KV cache) from the memory it sees free when it starts: it keeps (1 - F) of that
free for activations and CUDA graphs and fills the rest. Two servers that measure at the same
moment both see the whole card, and the second one's pool no longer fits once the first has
taken its own. So a sharing server starts only after every earlier server on its GPU is ready
(`start_waits`), and then each server's pool is at most F x the card's total: the sum of the
fractions x the total bounds what the sharers take (the preflight checks the card has it free,
checks/sharing.py).

Each server also holds memory outside its fraction: its CUDA context (~0.5 GiB on Hopper), and
activations and CUDA graphs (measured: 37.8 GiB for a server at 0.25 on an H200 of 139.8 GiB,
2.9 GiB beyond its fraction). Hence the bound SHARED_FRACTION_MAX = 0.90: the tenth of the card
left over (8 GiB on an 80 GiB H100) is the room two or three servers need beside their pools.

Sharing is explicit: every server on the GPU says `share_gpus = true` and names its fraction in
`[servers.X.options] mem-fraction-static`. Anything else is one line (exit 2) naming the file,
the servers and the figures. Everything here is per node: GPU 0 of one machine is not GPU 0 of
another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..errors import ConfigError
from . import cluster
from .model import ProcessSpec

#: the most the mem-fraction-static of a GPU's sharers may add up to (see the module docstring)
SHARED_FRACTION_MAX = 0.90
#: the SGLang option that says how much of the card a server takes
FRACTION_OPTION = "mem-fraction-static"
#: how a refusal says to opt in
HOW_TO_SHARE = ("to share a GPU, set share_gpus = true and options.mem-fraction-static "
                "on every server that uses it")

GpuKey = tuple[str | None, int]  # (node, GPU index): a GPU of one machine


def fraction_of(spec: ProcessSpec) -> float | None:
    """The server's mem-fraction-static as the profile says it, None when it says none (or says
    something that is not a fraction: the loader refuses that for a sharing server)."""
    value = spec.option(FRACTION_OPTION)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def sharers(specs: Iterable[ProcessSpec]) -> dict[GpuKey, list[ProcessSpec]]:
    """Every GPU used by more than one process, with its users in the order given."""
    users: dict[GpuKey, list[ProcessSpec]] = {}
    for s in specs:
        for node in cluster.nodes_of(s):
            for g in s.gpus:
                users.setdefault((node, g), []).append(s)
    return {k: v for k, v in users.items() if len(v) > 1}


def check_shared_gpus(path: Path, specs: Sequence[ProcessSpec]) -> None:
    """Refuse a GPU shared without everyone's consent, a sharer without its fraction, and
    fractions that add up to more than the card (ConfigError, exit 2)."""
    for s in specs:
        if s.share_gpus:
            _check_fraction(path, s)
    for (node, g), users in sharers(specs).items():
        on = f" on node {node!r}" if node else ""
        refusing = [u for u in users if not u.share_gpus]
        if refusing:
            second = users[1]
            lacking = " and ".join(u.key for u in refusing)
            verb = "does" if len(refusing) == 1 else "do"
            raise ConfigError(path, f"{second.key}.gpus",
                              f"GPU {g}{on} is also used by {users[0].key} ({lacking} {verb} not set share_gpus = true); "
                              + HOW_TO_SHARE)
        total = sum(fraction_of(u) or 0.0 for u in users)
        if total > SHARED_FRACTION_MAX + 1e-9:
            parts = ", ".join(f"{u.key} {fraction_of(u):g}" for u in users)
            raise ConfigError(path, f"{users[-1].key}.options.{FRACTION_OPTION}",
                              f"GPU {g}{on} is shared by {parts}: their mem-fraction-static add up to {total:.2f}, "
                              f"more than {SHARED_FRACTION_MAX:.2f} of the card (each server also holds its CUDA "
                              "context, activations and CUDA graphs outside its fraction); lower the fractions")


def _check_fraction(path: Path, s: ProcessSpec) -> None:
    key = f"{s.key}.options.{FRACTION_OPTION}"
    value = s.option(FRACTION_OPTION)
    if value is None:
        raise ConfigError(path, key, f"is required with share_gpus = true: say how much of each GPU {s.key} "
                                     f"takes (e.g. {FRACTION_OPTION} = 0.2); the fractions of a GPU's servers "
                                     f"may add up to {SHARED_FRACTION_MAX:.2f}")
    fraction = fraction_of(s)
    if fraction is None or not 0.0 < fraction < 1.0:
        raise ConfigError(path, key, f"must be a number above 0 and below 1 with share_gpus = true, not {value!r}")


# ----------------------------------------------------------------------------- start order


def start_waits(processes: Sequence[ProcessSpec]) -> dict[str, tuple[str, ...]]:
    """What each process waits for, ready, before it may start: its `after`, and every process
    earlier in `processes` (the start order) that shares a GPU with it on its node."""
    waits: dict[str, list[str]] = {p.name: list(p.after) for p in processes}
    for users in sharers(processes).values():
        for i, later in enumerate(users):
            for earlier in users[:i]:
                if earlier.name not in waits[later.name]:
                    waits[later.name].append(earlier.name)
    return {name: tuple(w) for name, w in waits.items()}


def may_start(name: str, waits: Mapping[str, tuple[str, ...]], ready: Iterable[str]) -> bool:
    """Whether process `name` may be spawned now, given the processes already ready."""
    done = set(ready)
    return all(w in done for w in waits.get(name, ()))


def startable(processes: Sequence[ProcessSpec], started: Iterable[str], ready: Iterable[str]) -> list[str]:
    """The processes that may be spawned now: not started yet, and all they wait for ready."""
    waits, began, done = start_waits(processes), set(started), set(ready)
    return [p.name for p in processes if p.name not in began and may_start(p.name, waits, done)]
