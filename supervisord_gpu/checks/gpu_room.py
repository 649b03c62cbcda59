"""Before a start: does each shared GPU have the memory its servers will take?

Servers that share a GPU (config/sharing.py) each take their mem-fraction-static of the card's
total, at most, plus a CUDA context outside it. A card that is idle is not necessarily empty:
its driver-reserved memory, its idle baseline (a display, the v1 reservation) and what the
idle tolerance lets pass are not free. So the preflight adds up what the sharers need and compares it with what the
card has free; short, the start is refused (PreconditionError, exit 3, as for a busy GPU: the
card is not ready for this profile now, and the same profile may fit another machine or a
card with a smaller baseline, so it is not a configuration error).

A GPU that is not idle at the time of the check (ours, about to be taken over) is judged as it
will be once clear: its baseline plus the tolerance in use, the most an idle card may hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..config.model import Profile
from ..config.sharing import fraction_of, sharers
from .gpus import GpuState

#: what each process holds outside its fraction: its CUDA context (~300-500 MiB on Hopper)
CONTEXT_MIB = 512


def shared_gpu_needs(profile: Profile) -> dict[int, list[tuple[str, float]]]:
    """Each shared GPU of this machine's part: (server key, fraction) of each server on it."""
    return {g: [(u.key, fraction_of(u) or 0.0) for u in users]
            for (_node, g), users in sharers(profile.processes).items()}


def need_mib(fractions: Iterable[float], total_mib: int) -> int:
    """What servers with these fractions take of a card of `total_mib`: their pools and contexts."""
    fs = list(fractions)
    return sum(math.ceil(f * total_mib) for f in fs) + CONTEXT_MIB * len(fs)


def room_problems(profile: Profile, states: Iterable[GpuState], tolerance_mib: int) -> list[str]:
    """One line per shared GPU whose free memory does not cover what its servers need."""
    needs = shared_gpu_needs(profile)
    lines = []
    for g in states:
        users = needs.get(g.index)
        if not users:
            continue
        used = g.used_mib if g.idle else g.baseline_mib + tolerance_mib
        free = g.total_mib - g.reserved_mib - used
        need = need_mib((f for _, f in users), g.total_mib)
        if free < need:
            who = ", ".join(f"{key} ({f:g})" for key, f in users)
            lines.append(f"GPU {g.index} has {free} MiB free of {g.total_mib} MiB ({g.reserved_mib} MiB reserved by "
                         f"the driver, {used} MiB in use{'' if g.idle else ' once idle'}), "
                         f"but {who} need {need} MiB (their mem-fraction-static of the total, "
                         f"and {CONTEXT_MIB} MiB of CUDA context each)")
    return lines
