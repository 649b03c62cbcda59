"""The daemon's assembly: config -> profile -> instance -> controller, then the controller's life.

`supervisord-gpu run NAME` (under systemd) and `gpusupctl rehearse NAME` (in a terminal)
both come here; rehearsal only swaps SGLang for stand-ins and NVML for simulated GPUs, and
that is decided here once (`backends_for`: one Backends record, handed down). The collaborators
are made here too, once: systemd's units client, the registry, the transition lock.
Nothing here decides anything else: the lifecycle (start, take over, roll back, restart, stop)
is controller/controller.py; this file wires it to signals, sd_notify, D-Bus and metrics.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from .records import dataclass, field
from typing import Any

from .config.loader import effective_config, load_daemon_config, load_profile
from .config.model import DaemonConfig, Profile
from .config.render import Programs, render
from .controller.backends import Backends
from .controller.controller import InstanceController
from .controller import parked
from .controller.lock import TransitionLock
from .controller.registry import Registry
from .controller.transition import ClusterTransition, LocalTransition, Transition
from .controller.units import Units
from .engine.events import Event
from .engine.instance import Instance
from .errors import SupervisorError
from .ownership import choose_driver, under_systemd_service
from .systemd.journal import open_sink
from .api.notify import Notifier, status_text


@dataclass
class RunOptions:
    rehearsal: bool = False
    force_stderr: bool = False
    #: called once the instance is ready (rehearsal uses it to demo, tests to act)
    on_ready: Callable[[Instance], None] | None = None
    stop_after_ready: bool = False
    listeners: list[Callable[[Event], None]] = field(default_factory=list)
    notifier: Notifier | None = None
    quiet_children: bool = False
    #: serve the D-Bus API ("auto": when a system bus is reachable)
    bus: str = "auto"
    #: True when a SIGTERM came before the daemon's handlers were installed (cli/daemon.py)
    stopped_early: Callable[[], bool] = lambda: False
    #: our own dsv4@NAME.service when run as it (systemd/restarts.py: the crash-loop limit)
    own_unit: Any = None


def programs_for(cfg: DaemonConfig) -> Programs:
    """SGLang and its router from the config, or (rehearsal) the stand-ins and their environment."""
    if cfg.rehearsal.enabled:
        from .rehearsal.setup import stand_ins

        return stand_ins(cfg)
    return Programs.of(cfg)


def parker_for(cfg: DaemonConfig, backends: Backends, inventory: Any,
               say: Callable[[str, int, str], None]) -> tuple[Any, str]:
    """The Parker on this machine's mechanism (parking.open_checkpointer: the simulated GPUs' where
    the GPUs are simulated, a rehearsal or `gpus.backend = "simulated"` as inventory_for reads them;
    else the CUDA driver API, else cuda-checkpoint), or None and the one line why not."""
    from .checks.gpus import simgpu_dir
    from .controller.parking import Parker
    from .parking import open_checkpointer
    from .parking.checkpointer import CheckpointUnavailable

    simulated = backends.rehearsal or cfg.gpus.backend == "simulated"
    try:
        checkpointer = open_checkpointer(str(simgpu_dir(cfg)) if simulated else None)
    except CheckpointUnavailable as e:
        return None, str(e)
    return Parker(checkpointer, inventory, lambda message, priority: say(message, priority, "park")), ""


def backends_for(cfg: DaemonConfig) -> Backends:
    """Real or rehearsal, decided here and nowhere below: what runs, the GPUs it is checked
    against, how its options are checked, whether its model must be on disk."""
    from functools import partial

    from .checks.gpus import inventory_for
    from .sglang.flags import check_server_flags

    if cfg.rehearsal.enabled:
        gpus = inventory_for(cfg, simulated=True)  # made now: the stand-ins hold their memory there
        return Backends(programs_for(cfg), lambda: gpus, partial(check_server_flags, use_real=False),
                        model_paths_must_exist=False, rehearsal=True)
    return Backends(programs_for(cfg), lambda: inventory_for(cfg, simulated=False), check_server_flags,
                    model_paths_must_exist=True)


def local_units() -> Units | None:
    """systemd's units where this daemon runs as a dsv4@ unit (a takeover stops and starts its
    neighbours there); None elsewhere (a terminal, the device machine, a rehearsal): the registry's
    daemons are then the only ones ours to stop."""
    if not under_systemd_service():
        return None
    from .systemd.manager import Systemd

    try:
        return Systemd()
    except SupervisorError:  # no system bus at all: no unit of ours can be seen, as before
        return None


def build_instance(cfg: DaemonConfig, profile: Profile, opts: RunOptions,
                   backends: Backends | None = None):
    """Everything but starting: the driver, the log sink, the rendered launches, the instance."""
    backends = backends if backends is not None else backends_for(cfg)
    sink = open_sink(profile.name, force_stderr=opts.force_stderr)
    if opts.quiet_children and hasattr(sink, "quiet_children"):
        sink.quiet_children = True
    for spec in profile.processes:
        sink.roles[spec.name] = spec.role
    driver = choose_driver(cfg.ownership, cfg.cgroup_root, profile.name, warn=lambda m: sink.event(m, 4))
    launches = render(profile, cfg, backends.programs)
    gate = None
    if profile.is_cluster:  # a node's part: its order against the other nodes goes through etcd
        from .cluster.gate import ClusterGate
        from .cluster.store import ClusterStore
        from .config.cluster import insecure_warning

        if warning := insecure_warning(cfg.cluster):
            sink.event(warning, 4)
        gate = ClusterGate(ClusterStore(cfg.cluster), profile, cfg.cluster.node, lambda m, prio: sink.event(m, prio))
    instance = Instance(profile, launches, driver, sink, leftovers=cfg.leftovers, gate=gate,
                        start_stall_s=cfg.start_stall_timeout_s)
    if gate is not None:
        instance.listeners.append(gate.on_event)
    return instance, sink


async def serve(cfg: DaemonConfig, profile: Profile, opts: RunOptions) -> int:
    """Run one instance through its controller until it stops; returns the daemon's exit status."""
    loop = asyncio.get_running_loop()
    notifier = opts.notifier or Notifier(stall_s=cfg.start_stall_timeout_s)
    try:
        backends = backends_for(cfg)
        instance, sink = build_instance(cfg, profile, opts, backends)
    except SupervisorError as e:  # etcd out of reach for a node's part: nothing started, said in STATUS=
        notifier.status(f"failed: {str(e).splitlines()[0]}")
        notifier.barrier()
        raise
    notifier.attach(instance)
    instance.listeners.extend(opts.listeners)
    if opts.own_unit is not None:  # ready long enough: earlier crashes stop counting (systemd/restarts.py)
        from .systemd.restarts import ForgetWhenHealthy

        instance.listeners.append(ForgetWhenHealthy(
            opts.own_unit, loop, lambda message, priority: sink.event(message, priority, GPUSUP_EVENT="restart-limit")).on_event)
    sink.event(
        f"instance {profile.name}: {len(profile.processes)} process(es), ownership driver {instance.owner.name}"
        + (" (REHEARSAL: stand-in servers, simulated GPUs)" if backends.rehearsal else ""),
        6,
        GPUSUP_EVENT="begin",
    )
    keepalive = loop.create_task(notifier.run(instance, healthy=lambda: instance.state.value != "failed"))
    exporter: Any = None
    bus: Any = None
    controller: InstanceController | None = None
    records = Registry(cfg.runtime_dir)
    lock = TransitionLock(cfg.runtime_dir, profile.name)
    try:
        try:
            inventory = backends.inventory
        except SupervisorError as e:  # NVML missing, simulated GPUs unreadable: say it in STATUS= too
            instance.fail(str(e))
            raise
        if cfg.metrics.enabled:
            from .metrics import MetricsExporter

            exporter = MetricsExporter(cfg.metrics, instance, inventory)
            exporter.start()
            instance.listeners.append(exporter.on_event)
            exporter.watch_loop(loop)

        def say(message: str, priority: int, event: str) -> None:
            sink.event(message, priority, GPUSUP_EVENT=event)

        transition: Transition = (ClusterTransition(profile, cfg, inventory, instance.gate, say) if instance.gate is not None
                                  else LocalTransition(profile, cfg, backends, say, local_units(), records))  # decided once, here
        controller = InstanceController(
            cfg, profile, instance, backends, say=say, transition=transition, lock=lock,
            on_transition=exporter.transition_observed if exporter else None,
            wrap_preflight=exporter.counting_preflight if exporter else None,
        )
        if instance.gate is None:  # parking is one machine's (issue 39); the mechanism chosen once, here
            controller.parker, controller.no_parking = parker_for(cfg, backends, inventory, say)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, controller.request_stop)
        if opts.stopped_early():
            controller.request_stop()
        bus = start_bus(cfg, profile, controller, opts, sink)
        parked.remove(cfg.runtime_dir, profile.name)  # a record of a life before this one parks nothing
        records.register(profile, instance.owner.name)
        on_ready = (lambda: opts.on_ready(instance)) if opts.on_ready else None  # type: ignore[misc]
        code = await controller.run(on_ready=on_ready, stop_after_ready=opts.stop_after_ready)
        if controller.stop_requested.is_set():
            notifier.send("STOPPING=1")
        return code
    finally:
        notifier.status(status_text(instance.status()))
        notifier.barrier()  # the last STATUS= must reach systemd before we exit
        if exporter is not None:
            exporter.stop()
        lock.release()
        if controller is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        records.unregister(profile.name)
        parked.remove(cfg.runtime_dir, profile.name)
        if instance.gate is not None:
            instance.gate.close()
        keepalive.cancel()
        if bus is not None:
            bus.close()


def start_bus(cfg: DaemonConfig, profile: Profile, controller: InstanceController, opts: RunOptions, sink):
    """Publish the instance on the system bus; without a bus the daemon still runs, and says so."""
    if opts.bus == "off":
        return None
    try:
        from .api.service import BusService, Controls
    except ImportError as e:  # pydbus/PyGObject not installed (a bare GPU box): run without the bus
        sink.event(f"D-Bus API not available ({e}); running without it", 4)
        return None

    loop = asyncio.get_running_loop()
    instance = controller.instance
    try:
        service = BusService(profile.name, loop, Controls(controller, loop), cfg.control_group, say=sink.event)
    except Exception as e:  # no bus, or the name is taken: run on, loudly
        if opts.bus == "on":
            raise
        sink.event(f"D-Bus API not available ({e}); running without it", 4)
        return None

    def publish(event: Event | None = None) -> None:
        st = instance.status()
        service.publish(st.to_json(), status_text(st))
        if event is not None and event.kind in ("instance", "process"):
            service.emit(event.process or "", event.state or "", event.message)

    instance.listeners.append(publish)
    publish()

    async def refresh() -> None:  # phase elapsed times move on even when nothing happens
        while True:
            await asyncio.sleep(1.0)
            publish()

    service.on_close(loop.create_task(refresh()).cancel)
    return service


def run(profile_name: str, config_dir: str | None, opts: RunOptions) -> int:
    """The daemon's entry point. A config or profile error is also systemd's STATUS= (so that
    `systemctl status` and `gpusupctl status` say why), then one line and exit 2 (cli/common.py).
    First of all, the crash-loop limit: systemd restarted us too often since the last start by
    hand, exit 6 before anything is loaded (systemd/restarts.py)."""
    try:
        from .systemd.restarts import check_at_start

        opts.own_unit = check_at_start(profile_name)
    except SupervisorError as e:
        early = opts.notifier or Notifier()
        early.status(f"failed: {e}")
        early.barrier()
        raise
    try:
        cfg = effective_config(load_daemon_config(config_dir), opts.rehearsal)
        profile = load_profile(cfg, profile_name)
    except SupervisorError as e:
        early = opts.notifier or Notifier()
        early.status(f"failed: {str(e).splitlines()[0]}")
        early.barrier()
        raise
    return asyncio.run(serve(cfg, profile, opts))
