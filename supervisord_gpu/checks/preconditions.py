"""Before a start: are the GPUs a profile needs idle and its ports free, and if not, who holds them.

Two ways to ask. `check` answers once, with every holder named (PID, user, command line,
cgroup, ours or foreign): for refusals and `gpusupctl check`. `wait_until_clear` answers as
soon as everything is clear, for the moment right after a takeover stopped the old holders:
it polls only what is cheap (the required GPUs' memory and process lists, a bind test per
port — tens of µs each) every few milliseconds, so it returns within a poll interval of the
last holder's death, and names holders (a walk over /proc, milliseconds) only when it reports
progress and at its deadline. Every read runs in a worker thread: NVML and /proc can block,
and the daemon's loop reaps children and answers clients meanwhile.

`survey` is `check` for `gpusupctl check`: a GPU inventory that cannot be read is one more
problem in the report, not the end of it, so the ports are still checked and their holders named.

Also here: the renderings the CLI prints (`gpusupctl gpus`, `gpusupctl check --json`).
"""

from __future__ import annotations

from ..records import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable

from ..errors import ConfigError, PreconditionError, SupervisorError
from .gpus import GpuInventory, GpuState
from .holders import Holder, describe_gpu_pid

if TYPE_CHECKING:  # the port checks (socket, ipaddress) load only when ports are checked: `gpus` never does
    from ..config.model import Profile
    from .ports import PortStatus

TABLE_WIDTH = 80
SUMMARY_WIDTH = 200
# How long past its deadline wait_until_clear waits for a read that hangs (a GPU in trouble
# can stall NVML for seconds) before it gives up on it.
HUNG_READ_GRACE_S = 5.0


@dataclass(frozen=True)
class Requirement:
    """What a profile needs: GPU indices, and (host, port, label) for every listening socket."""

    gpus: frozenset[int]
    ports: tuple[tuple[str, int, str], ...] = ()

    @classmethod
    def of(cls, profile: Profile) -> Requirement:
        """A profile's GPUs and listeners: what a start, a switch and a node's verify step check."""
        return cls(gpus=profile.gpus,
                   ports=tuple((listen.host, listen.port, listen.label) for listen in profile.listens()))


@dataclass
class PreconditionReport:
    """The required GPUs and ports at one instant.

    gpu_holders: the holders of each required GPU (empty for idle ones); left empty by the
    cheap polls of wait_until_clear (attributed=False). missing_gpus: required indices the
    inventory lacks (a config error, not something to wait for). gpu_count: GPUs visible.
    gpu_error: why the GPUs could not be read at all (survey only; the ports were still checked).
    """

    gpus: list[GpuState]
    ports: list[PortStatus]
    gpu_holders: dict[int, list[Holder]]
    missing_gpus: list[int]
    gpu_count: int | None = None
    attributed: bool = True
    backend: str | None = None
    gpu_error: str | None = None

    @property
    def ok(self) -> bool:
        return (not self.missing_gpus and self.gpu_error is None and all(g.idle for g in self.gpus)
                and all(p.free for p in self.ports))

    def problems(self, missing: bool = True) -> list[str]:
        """One line per GPU or port not clear, naming every holder. missing=False leaves out the
        GPUs the machine lacks: `gpusupctl check` names those as the profile keys that ask for them."""
        lines = [_missing_problem(i, self.gpu_count) for i in self.missing_gpus] if missing else []
        if self.gpu_error is not None:
            lines.append(f"GPUs not checked: {self.gpu_error}")
        lines += [_gpu_problem(g, self.gpu_holders.get(g.index)) for g in self.gpus if not g.idle]
        lines += [p.problem() or "" for p in self.ports if not p.free]
        return lines

    def summary(self) -> str:
        """A short line for sd_notify STATUS= and progress messages."""
        if self.ok:
            gpus = ",".join(str(g.index) for g in self.gpus) or "none"
            ports = ",".join(str(p.port) for p in self.ports) or "none"
            return f"GPUs {gpus} idle; ports {ports} free"
        items = [f"GPU {i} missing" for i in self.missing_gpus]
        for g in self.gpus:
            if not g.idle:
                items.append(f"GPU {g.index} {_short_holders(self.gpu_holders.get(g.index), [p.pid for p in g.processes])}")
        for p in self.ports:
            if not p.free:
                items.append(f"port {p.port} " + (p.error if p.error else _short_holders(list(p.holders), [])))
        return _clip("not clear: " + "; ".join(items), SUMMARY_WIDTH)

    def to_json(self) -> dict[str, Any]:
        """Stable keys for `gpusupctl check --json` and the D-Bus API."""
        return {
            "ok": self.ok,
            "backend": self.backend,
            "gpu_count": self.gpu_count,
            "missing_gpus": list(self.missing_gpus),
            "gpus": [gpu_json(g, self.gpu_holders.get(g.index, [])) for g in self.gpus],
            "ports": [p.to_json() for p in self.ports],
            "problems": self.problems(),
        }


# ----------------------------------------------------------------------------- checking


def check(req: Requirement, inventory: GpuInventory) -> PreconditionReport:
    """The required GPUs and ports now, every holder named. Blocking: call it off the loop."""
    return _probe(req, inventory, attribute=True)


def survey(req: Requirement, open_inventory: Callable[[], GpuInventory]) -> PreconditionReport:
    """`check` for a person asking what stands in a profile's way: a GPU inventory that cannot be
    opened or read (no NVML, a driver in trouble) becomes the report's gpu_error, and the ports
    are still checked, every holder named. A start still stops at such an error (check)."""
    try:
        return check(req, open_inventory())
    except SupervisorError as e:
        from .ports import check_ports

        return PreconditionReport([], check_ports(req.ports), {}, [], None, True, None, gpu_error=str(e))


def missing_gpu_errors(profile: Profile, report: PreconditionReport) -> list[ConfigError]:
    """Each profile key that asks for a GPU the machine lacks: a configuration error, not
    something to wait for (what the daemon raises for the first of them, preflight.py)."""
    total = report.gpu_count if report.gpu_count is not None else len(report.gpus)
    return [ConfigError(profile.path, f"servers.{spec.name}.gpus[{i}]",
                        f"GPU {g} does not exist (this machine has {total} visible GPU(s))")
            for spec in profile.processes for i, g in enumerate(spec.gpus) if g in report.missing_gpus]


def _probe(req: Requirement, inventory: GpuInventory, attribute: bool) -> PreconditionReport:
    count = inventory.count()
    missing = sorted(i for i in req.gpus if not 0 <= i < count)
    states = inventory.snapshot(sorted(set(req.gpus) - set(missing)))
    from .ports import PortStatus, bind_test, check_ports

    if attribute:
        holders = {s.index: [describe_gpu_pid(p.pid, inventory.pids_local) for p in s.processes] for s in states}
        ports = check_ports(req.ports)
    else:
        holders = {}
        ports = []
        for host, port, label in req.ports:
            free, error = bind_test(host, port)  # (free, error): the error is not a holder
            ports.append(PortStatus(host, port, label, free, (), error))
    return PreconditionReport(states, ports, holders, missing, count, attribute, inventory.kind)


async def wait_until_clear(
    req: Requirement,
    inventory: GpuInventory,
    deadline_s: float,
    poll_interval_s: float = 0.005,
    on_progress: Callable[[PreconditionReport], None] | None = None,
    progress_every_s: float = 1.0,
) -> PreconditionReport:
    """Return the first clear report; raise PreconditionError naming every holder at the deadline.

    A required GPU that does not exist raises at once: waiting cannot make it appear.
    on_progress, if given, gets a report with holders named every progress_every_s.
    """
    import asyncio  # here, not at the top: `gpusupctl gpus` and `check` never wait

    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + deadline_s
    next_progress = began + progress_every_s

    async def read(attribute: bool) -> PreconditionReport:
        timeout = max(0.0, deadline - loop.time()) + HUNG_READ_GRACE_S
        try:
            return await asyncio.wait_for(asyncio.to_thread(_probe, req, inventory, attribute), timeout)
        except TimeoutError:
            raise PreconditionError(
                f"the {inventory.kind} GPU inventory did not answer within {timeout:.0f} s; "
                "check the driver (nvidia-smi) and dmesg"
            ) from None

    report = await read(False)
    while True:
        if report.missing_gpus:
            raise PreconditionError("; ".join(_missing_problem(i, report.gpu_count) for i in report.missing_gpus))
        if report.ok:
            return report
        now = loop.time()
        if now >= deadline:
            report = await read(True)
            if report.ok:
                return report
            raise PreconditionError(f"still not clear after {deadline_s:g} s: " + "; ".join(report.problems()))
        if on_progress is not None and now >= next_progress:
            report = await read(True)
            if report.ok:
                return report
            on_progress(report)
            next_progress = loop.time() + progress_every_s
        await asyncio.sleep(max(0.0, min(poll_interval_s, deadline - loop.time())))
        report = await read(False)


# ----------------------------------------------------------------------------- lines and JSON


def _missing_problem(index: int, count: int | None) -> str:
    if count is None:
        return f"GPU {index} does not exist"
    if count == 0:
        return f"GPU {index} does not exist (this machine has no GPUs)"
    valid = "index 0" if count == 1 else f"indices 0-{count - 1}"
    return f"GPU {index} does not exist (this machine has {count} GPU{'s' if count > 1 else ''}: {valid})"


def _gpu_problem(g: GpuState, holders: list[Holder] | None) -> str:
    line = f"GPU {g.index} not idle: {g.in_use_mib} MiB used"
    if g.baseline_mib:
        line += f" above its idle baseline of {g.baseline_mib} MiB"
    if holders:
        return line + "; held by " + " and ".join(h.describe() for h in holders)
    if g.processes:
        return line + "; held by " + " and ".join(f"pid {p.pid}" for p in g.processes)
    return line + ", no process listed (a holder the driver does not show us, or memory still being freed)"


def _short_holders(holders: list[Holder] | None, pids: list[int]) -> str:
    if holders:
        return "held by " + ", ".join(
            f"pid {h.pid} ({h.owner.instance}/{h.owner.process})" if h.owner else
            f"pid {h.pid} ({'foreign' if h.known else 'unknown'})" for h in holders)
    if pids:
        return "held by " + ", ".join(f"pid {p}" for p in pids)
    return "busy, no process listed"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def gpu_json(state: GpuState, holders: Iterable[Holder]) -> dict[str, Any]:
    return {
        "index": state.index,
        "uuid": state.uuid,
        "name": state.name,
        "total_mib": state.total_mib,
        "used_mib": state.used_mib,
        "reserved_mib": state.reserved_mib,
        "baseline_mib": state.baseline_mib,
        "in_use_mib": state.in_use_mib,
        "idle": state.idle,
        "processes": [{"pid": p.pid, "used_mib": p.used_mib} for p in state.processes],
        "holders": [h.to_json() for h in holders],
    }


def render_gpu_table(states: list[GpuState], holders_by_gpu: dict[int, list[Holder]]) -> str:
    """`gpusupctl gpus`: one row per GPU (more for several holders), 80 columns wide."""
    if not states:
        return "no GPUs"
    names = sorted({s.name for s in states})
    lines = [f"{len(states)} × {' / '.join(names)}"]
    lines.append(f"{'GPU':>3}  {'MiB USED/TOTAL':>15}  {'STATE':<6}  HOLDERS")
    indent = 3 + 2 + 15 + 2 + 6 + 2
    room = TABLE_WIDTH - indent
    for s in states:
        holders = holders_by_gpu.get(s.index)
        if holders:
            cells = [h.short(room) for h in holders]
        elif s.processes:
            cells = [f"pid {p.pid}" for p in s.processes]
        else:
            cells = ["-" if s.idle else "(no process listed)"]
        memory = f"{s.in_use_mib}/{s.total_mib}"
        lines.append(_clip(f"{s.index:>3}  {memory:>15}  {'idle' if s.idle else 'in use':<6}  {cells[0]}", TABLE_WIDTH))
        lines += [_clip(" " * indent + c, TABLE_WIDTH) for c in cells[1:]]
    return "\n".join(lines)
