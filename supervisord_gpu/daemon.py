"""The daemon's assembly: config -> profile -> driver -> instance, then serve until told to stop.

`supervisord-gpu run NAME` (under systemd) and `gpusupctl rehearse NAME` (in a terminal)
both come here; rehearsal only swaps SGLang for stand-ins and NVML for simulated GPUs.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from collections.abc import Callable

from .config.loader import effective_config, load_daemon_config, load_profile  # noqa: F401
from .config.model import DaemonConfig, Profile
from .config.render import render
from .engine.events import Event
from .engine.instance import Instance
from .errors import EXIT_FAILED, EXIT_OK, SupervisorError, TakeoverFailed
from .ownership import choose_driver
from .systemd.journal import open_sink
from .systemd.notify import Notifier, status_text


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


def build_instance(cfg: DaemonConfig, profile: Profile, opts: RunOptions):  # type: ignore[no-untyped-def]
    """Everything but starting: the driver, the log sink, the rendered launches, the instance."""
    sink = open_sink(profile.name, force_stderr=opts.force_stderr)
    if opts.quiet_children and hasattr(sink, "quiet_children"):
        sink.quiet_children = True
    for spec in profile.processes:
        sink.roles[spec.name] = spec.role
    rehearsal_env = None
    if cfg.rehearsal.enabled:
        from .rehearsal.setup import prepare

        _, rehearsal_env = prepare(cfg)
    driver = choose_driver(cfg.ownership, cfg.cgroup_root, profile.name, warn=lambda m: sink.event(m, 4))
    launches = render(profile, cfg, rehearsal_env)
    instance = Instance(profile, launches, driver, sink, leftovers=cfg.leftovers)
    return instance, sink


async def serve(cfg: DaemonConfig, profile: Profile, opts: RunOptions) -> int:
    from .preflight import inventory_for, prepare_start

    loop = asyncio.get_running_loop()
    instance, sink = build_instance(cfg, profile, opts)
    notifier = opts.notifier or Notifier(stall_s=cfg.start_stall_timeout_s)
    notifier.attach(instance)
    instance.listeners.extend(opts.listeners)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sink.event(
        f"instance {profile.name}: {len(profile.processes)} process(es), ownership driver {instance.owner.name}"
        + (" (REHEARSAL: stand-in servers, simulated GPUs)" if cfg.rehearsal.enabled else ""),
        6,
        GPUSUP_EVENT="begin",
    )
    keepalive = loop.create_task(notifier.run(instance, healthy=lambda: instance.state.value != "failed"))
    bus = start_bus(cfg, profile, instance, stop, opts, sink)
    from . import registry
    from .transition import TransitionLock, start_instance

    lock = TransitionLock(cfg.runtime_dir, profile.name)
    stopped: list = []  # type: ignore[type-arg]

    async def preflight() -> None:
        await lock.acquire()
        await prepare_start(profile, cfg, inventory, say=lambda m, p: sink.event(m, p, GPUSUP_EVENT="transition"),
                            progress=instance.set_transition, stopped=stopped)
        instance.set_transition("")

    exporter = None
    try:
        inventory = inventory_for(cfg, cfg.rehearsal.enabled)
        if cfg.metrics.enabled:
            from .metrics import MetricsExporter

            exporter = MetricsExporter(cfg.metrics, instance, inventory)
            exporter.start()
            instance.listeners.append(exporter.on_event)
            exporter.watch_loop(loop)
        registry.register(cfg.runtime_dir, profile, instance.owner.name)
        start = loop.create_task(instance.start(preflight=exporter.counting_preflight(preflight) if exporter else preflight))
        stopper = loop.create_task(stop.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # told to stop while starting: abandon the start, stop in order
            start.cancel()
            try:
                await start
            except (asyncio.CancelledError, SupervisorError):
                pass
            lock.release()
            notifier.send("STOPPING=1")
            return EXIT_OK
        stopper.cancel()
        lock.release()
        exc = start.exception()
        if exc is not None:
            instance.set_transition("")
            notifier.status(status_text(instance.status()))
            sink.event(str(exc), 3, GPUSUP_EVENT="start-failed")
            if not stopped:
                raise exc
            if profile.rollback:
                for c in stopped:
                    try:
                        start_instance(c)
                        sink.event(f"rollback: {profile.name} failed to start; dsv4@{c.instance} started again", 4,
                                   GPUSUP_EVENT="rollback")
                    except SupervisorError as e:
                        sink.event(f"rollback of dsv4@{c.instance} failed: {e}", 3, GPUSUP_EVENT="rollback")
            raise TakeoverFailed(f"{exc} (after taking over {', '.join('dsv4@' + c.instance for c in stopped)}"
                                 + ("; rolled back" if profile.rollback else "; rollback = false") + ")") from exc
        if opts.on_ready:
            opts.on_ready(instance)
        if not opts.stop_after_ready:
            failed = loop.create_task(instance.failed.wait())
            stopper = loop.create_task(stop.wait())
            await asyncio.wait({failed, stopper}, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            stopper.cancel()
            if instance.failed.is_set():
                return EXIT_FAILED
        await instance.stop("stop requested")
        return EXIT_OK
    finally:
        notifier.status(status_text(instance.status()))
        notifier.barrier()  # the last STATUS= must reach systemd before we exit
        if exporter is not None:
            exporter.stop()
        lock.release()
        registry.unregister(cfg.runtime_dir, profile.name)
        keepalive.cancel()
        if bus is not None:
            bus.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def start_bus(cfg: DaemonConfig, profile: Profile, instance: Instance, stop: asyncio.Event, opts: RunOptions, sink):  # type: ignore[no-untyped-def]
    """Publish the instance on the system bus; without a bus the daemon still runs, and says so."""
    if opts.bus == "off":
        return None
    try:
        from .bus.service import BusService, Controls
    except ImportError as e:  # pydbus/PyGObject not installed (a bare GPU box): run without the bus
        sink.event(f"D-Bus API not available ({e}); running without it", 4)
        return None

    loop = asyncio.get_running_loop()

    async def request_stop() -> None:
        stop.set()

    async def restart_all() -> None:
        from .preflight import inventory_for, refuse_unless_clear

        await instance.stop("restart requested")
        inventory = inventory_for(cfg, cfg.rehearsal.enabled)
        try:
            await instance.start(preflight=lambda: refuse_unless_clear(profile, inventory))
        except SupervisorError as e:
            sink.event(f"restart failed: {e}", 3, GPUSUP_EVENT="start-failed")
            instance.failed.set()

    controls = Controls(request_stop, restart_all, instance.restart_process, lambda: list(instance.processes))
    try:
        service = BusService(profile.name, loop, controls, cfg.control_group)
    except Exception as e:  # no bus, or the name is taken: run on, loudly
        if opts.bus == "on":
            raise
        sink.event(f"D-Bus API not available ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); running without it", 4)
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
    cfg = effective_config(load_daemon_config(config_dir), opts.rehearsal)
    profile = load_profile(cfg, profile_name)
    return asyncio.run(serve(cfg, profile, opts))
