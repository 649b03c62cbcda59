"""`gpusupctl status`: collect what can be known, say what cannot, and lay it out as wide as the
terminal is (80 columns when the output is not a terminal, as in a pipe or a script)."""

from __future__ import annotations

import sys
import time
from typing import Any

from ..errors import SupervisorError

ACTIVE = ("active", "activating", "deactivating", "reloading")


def collect(config_dir: str | None, only: str | None = None) -> dict[str, Any]:
    """Everything `status` shows, as the stable JSON of `status --json` (documented in the README)."""
    notes: list[str] = []
    profiles: list[str] = []
    cfg = None
    try:
        from ..config.loader import list_profiles, load_daemon_config

        cfg = load_daemon_config(config_dir)
        profiles = list_profiles(cfg)
    except SupervisorError as e:
        notes.append(f"config: {e}")

    units: dict[str, Any] = {}
    bus = None
    try:
        from ..systemd.manager import Systemd

        systemd = Systemd()
        for u in systemd.instances():
            units[u.instance] = u
        bus = systemd.con
    except SupervisorError as e:
        notes.append(f"{e}; instance states unknown")
        bus = None

    instances = []
    for name in sorted(set(profiles) | set(units)):
        if only and name != only:
            continue
        unit = units.get(name)
        entry: dict[str, Any] = {
            "instance": name,
            "unit": f"dsv4@{name}.service",
            "active_state": unit.active if unit else ("unknown" if bus is None else "inactive"),
            "sub_state": unit.sub if unit else "",
            "since": (unit.since_us / 1e6) if unit and unit.since_us else None,
            # StatusText outlives the daemon that sent it: while systemd waits to restart a crashed
            # daemon (sub-state auto-restart) it is the dead one's last word, not the current state.
            "status_text": unit.status_text if unit and unit.main_pid else "",
            "last_status_text": unit.status_text if unit and not unit.main_pid else "",
            "main_pid": unit.main_pid if unit else 0,
            "result": unit.result if unit else "",
            "profile_exists": name in profiles,
            "daemon": None,
        }
        if bus is not None and unit is not None and unit.active in ACTIVE:
            try:
                from ..api.client import InstanceClient

                entry["daemon"] = InstanceClient(bus, name).status()
            except SupervisorError as e:
                notes.append(str(e))
        instances.append(entry)
    if only and not instances:
        notes.append(f"no instance or profile named {only!r}")

    gpus = None
    try:
        from ..checks.holders import describe_gpu_pid
        from ..checks.gpus import inventory_for

        if cfg is not None:
            inv = inventory_for(cfg, simulated=cfg.rehearsal.enabled)
            gpus = []
            for s in inv.snapshot():
                holders = [describe_gpu_pid(p.pid, inv.pids_local) for p in s.processes]
                gpus.append({
                    "index": s.index, "name": s.name, "used_mib": s.used_mib, "total_mib": s.total_mib, "idle": s.idle,
                    "holders": [
                        {"pid": h.pid, "owner": f"{h.owner.instance}/{h.owner.process}" if h.owner else None,
                         "description": h.describe()} for h in holders
                    ],
                })
            gpus_kind = inv.kind
        else:
            gpus_kind = None
    except SupervisorError as e:
        notes.append(f"GPUs unknown: {e}")
        gpus_kind = None
    return {"instances": instances, "gpus": gpus, "gpu_backend": gpus_kind, "notes": notes,
            "bus": bus is not None, "at": time.time()}


def _ago(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _ranges(gpus: list[int]) -> str:
    from ..config.model import gpu_ranges

    return gpu_ranges(gpus) if gpus else "-"


#: the narrowest layout: below it the columns would not hold their headings
MIN_WIDTH = 60


def terminal_width() -> int:
    """The terminal's columns ($COLUMNS first, as shutil does), 80 when not on a terminal."""
    import shutil

    return max(MIN_WIDTH, shutil.get_terminal_size((80, 24)).columns)


def render(data: dict[str, Any], colour: bool | None = None, width: int | None = None) -> str:
    """The text of `status`: `width` columns (default: the terminal's), colours only on a
    terminal. Colour codes take no columns: every cell is padded by the width a person sees."""
    colour = sys.stdout.isatty() if colour is None else colour
    width = terminal_width() if width is None else max(MIN_WIDTH, width)
    paint = {"active": "32", "ready": "32", "failed": "31", "activating": "33", "starting": "33", "degraded": "33",
             "deactivating": "33", "stopping": "33", "restarting": "33"}

    def c(text: str, key: str | None = None, pad: int = 0) -> str:
        """`text` painted for `key`, padded to `pad` visible columns (the padding unpainted)."""
        code = paint.get(key or text)
        padding = " " * max(0, pad - len(text))
        return (f"\033[{code}m{text}\033[0m" if colour and code else text) + padding

    now = data["at"]
    lines: list[str] = []
    for inst in data["instances"]:
        state = inst["active_state"]
        daemon = inst["daemon"]
        sub = inst.get("sub_state") or ""
        shown = daemon["state"] if daemon else state
        if sub and sub not in ("running", "dead", "exited", "failed", "start", shown):
            shown = f"{shown} ({sub})"  # e.g. "activating (auto-restart)", "deactivating (stop-sigterm)"
        up = f"  {'up' if state == 'active' else 'since'} {_ago(now - inst['since'])}" if inst["since"] else ""
        head = f"{inst['unit']:<28} {c(shown, daemon['state'] if daemon else state, 10)}{up}"
        lines.append(head)
        text = inst["status_text"] or (daemon or {}).get("reason", "")
        last = inst.get("last_status_text", "")
        if not text and last and state in ("failed", "inactive"):
            text, last = last, ""  # the finished daemon's final word is the reason it finished
        if state == "failed" and inst["result"]:
            text = f"{text} (result: {inst['result']})".strip()
        if text:
            lines += _wrapped(text, "  ", width)
        elif last:
            lines += _wrapped(f"last status (daemon gone): {last}", "  ", width)
        if daemon:
            lines.append(f"  {'PROCESS':<9}{'ROLE':<8}{'PID':>8} {'PORT':>6} {'GPUS':<6}{'PHASE':<20}{'RST':>3}  HEALTH")
            for p in daemon["processes"]:
                phase = (p["phase"] or "-")[:13] + (f" {_ago(p['phase_elapsed_s'])}" if p["phase"] else "")
                lines.append(
                    f"  {p['name'][:8]:<9}{p['role'][:7]:<8}{p['pid'] or '-':>8} {p['port']:>6} {_ranges(p['gpus']):<6}"
                    f"{phase[:19]:<20}{p['restarts']:>3}  {c(p['state'])}"
                    + ("  not serving (paused, latched by a failed /health, or draining)"
                       + (f" since {time.strftime('%H:%M:%S', time.localtime(p['not_serving_since']))}"
                          f" ({_ago(now - p['not_serving_since'])})" if p.get("not_serving_since") else "")
                       if p["state"] == "ready" and p.get("serving") is False else "")
                )
                if p.get("last_error") and p["state"] in ("failed", "restarting", "stopped"):
                    lines += _wrapped(f"last error: {p['last_error']}", "    ", width)  # root and the control group see it
    if not data["instances"]:
        lines.append("no dsv4@ instances and no profiles found")
    if data["gpus"] is not None:
        lines.append("")
        lines.append(f"GPUs ({data['gpu_backend']}):  {'GPU':<4}{'MEMORY USED/TOTAL':<22}{'IDLE':<6}HELD BY")
        for g in data["gpus"]:
            held = ", ".join(h["owner"] or f"pid {h['pid']} (foreign)" for h in g["holders"]) or "-"
            mem = f"{g['used_mib']}/{g['total_mib']} MiB"
            idle = c("yes", "ready", 6) if g["idle"] else c("no", "failed", 6)
            lines.append(f"{'':<14}{g['index']:<4}{mem:<22}{idle}{_clip(held, width - 47)}")
    for note in data["notes"]:
        lines += _wrapped(f"note: {note}", "", width)
    return "\n".join(lines)


def _clip(text: str, room: int) -> str:
    return text if len(text) <= room else text[: max(1, room - 1)] + "…"


def _wrapped(text: str, indent: str, width: int = 80) -> list[str]:
    """A reason is never cut: "restart limit reached" comes last in a long one. Wrapped at
    word boundaries two columns short of `width`, continuation lines indented two more."""
    import textwrap

    return textwrap.wrap(text, width - 2, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False) or [indent]
