"""Export methods to D-Bus with their signatures beside them (tuned's `@exports.export`).

The decorator records the in/out signatures and whether the method is a control method;
`introspection_xml(cls)` builds the XML pydbus publishes. So the bus surface of a class
reads as a list, and authorization is declared, and enforced, per method where the method
is defined.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any
from collections.abc import Callable
from xml.sax.saxutils import quoteattr

_ATTR = "_dbus_export"


def export(in_signature: str = "", out_signature: str = "", control: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method for the bus. `control=True` also *enforces* it: the method runs only after
    `self.authorize(dbus_context, name)` has passed, so no control method can forget the check."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        if control:
            name = fn.__name__

            @functools.wraps(fn)  # inspect.signature follows __wrapped__: pydbus still passes dbus_context
            def authorized(self: Any, *args: Any, dbus_context: Any = None) -> Any:
                self.authorize(dbus_context, name)
                return fn(self, *args, dbus_context=dbus_context)

            setattr(authorized, _ATTR, (in_signature, out_signature, control))
            return authorized
        setattr(fn, _ATTR, (in_signature, out_signature, control))
        return fn

    return mark


def _split(sig: str) -> list[str]:
    """Split a D-Bus signature into complete types: "sas(ii)" -> ["s", "as", "(ii)"]."""
    out, i = [], 0
    while i < len(sig):
        j = i
        while sig[j] == "a":
            j += 1
        if sig[j] in "({":
            depth = 0
            while True:
                depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(sig[j], 0)
                j += 1
                if depth == 0:
                    break
        else:
            j += 1
        out.append(sig[i:j])
        i = j
    return out


def exported_methods(cls: type) -> dict[str, tuple[str, str, bool]]:
    return {name: getattr(fn, _ATTR) for name, fn in inspect.getmembers(cls) if hasattr(fn, _ATTR)}


def introspection_xml(cls: type, interface: str, signals: dict[str, list[tuple[str, str]]],
                      properties: dict[str, str]) -> str:
    lines = ["<node>", f"  <interface name={quoteattr(interface)}>"]
    for name, (insig, outsig, _control) in sorted(exported_methods(cls).items()):
        params = [p for p in inspect.signature(getattr(cls, name)).parameters if p not in ("self", "dbus_context")]
        lines.append(f"    <method name={quoteattr(name)}>")
        for pname, t in zip(params, _split(insig), strict=False):
            lines.append(f"      <arg name={quoteattr(pname)} type={quoteattr(t)} direction=\"in\"/>")
        for t in _split(outsig):
            lines.append(f"      <arg type={quoteattr(t)} direction=\"out\"/>")
        lines.append("    </method>")
    for name, args in signals.items():
        lines.append(f"    <signal name={quoteattr(name)}>")
        lines += [f"      <arg name={quoteattr(a)} type={quoteattr(t)}/>" for a, t in args]
        lines.append("    </signal>")
    for name, t in properties.items():
        lines.append(f"    <property name={quoteattr(name)} type={quoteattr(t)} access=\"read\"/>")
    lines += ["  </interface>", "</node>"]
    return "\n".join(lines)
