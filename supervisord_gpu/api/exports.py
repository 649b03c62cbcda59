"""Export methods to D-Bus with their signatures beside them (tuned's `@exports.export`).

The decorator records the in/out signatures and whether the method is a control method;
`introspection_xml(cls)` builds the XML pydbus publishes. So the bus surface of a class
reads as a list, and authorization is declared, and enforced, per method where the method
is defined.

A method raises the errors of the table (errors.py); the wrapper hands each to pydbus under
its D-Bus name (bus/errors.py's `on_the_wire`), so a caller reads the name, and gpusupctl
exits with the error's own code.

Every string argument is bounded here too, before the method (or its authorization) runs:
process names are short, and a caller's 1 MiB name must cost the daemon no more than a short
one once the bus has handed it over (`MAX_STRING_BYTES`; refused with ArgumentTooLong, which
says how long it was and never echoes it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any
from collections.abc import Callable
from xml.sax.saxutils import quoteattr

from ..bus.errors import on_the_wire
from ..errors import ArgumentTooLong, SupervisorError

__all__ = ["ArgumentTooLong", "export", "exported_methods", "introspection_xml"]

_ATTR = "_dbus_export"

#: the longest string argument any method takes (UTF-8 bytes): names of processes, instances
#: and profiles are far shorter; the bus itself would carry up to 128 MiB
MAX_STRING_BYTES = 256
#: the longest array argument (items), should a method ever take one
MAX_ARRAY_ITEMS = 64



def export(in_signature: str = "", out_signature: str = "", control: bool = False,
           too_long: type[SupervisorError] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method for the bus. Its string arguments are bounded before anything else runs
    (`check_arguments`; an oversize one raises `too_long`, ArgumentTooLong unless the method
    names the error its callers already handle, UnknownProcess for a process name).
    `control=True` also *enforces* it: the method runs only after
    `self.authorize(dbus_context, name)` has passed, so no control method can forget the check."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        params = [p for p in inspect.signature(fn).parameters if p not in ("self", "dbus_context")]
        bounded = [(i, pname, t) for i, (pname, t) in enumerate(zip(params, _split(in_signature), strict=False))
                   if t in _STRING_TYPES or t.startswith("a")]
        takes_context = "dbus_context" in inspect.signature(fn).parameters

        @functools.wraps(fn)  # inspect.signature follows __wrapped__: pydbus still passes dbus_context
        def checked(self: Any, *args: Any, dbus_context: Any = None) -> Any:
            try:
                check_arguments(name, bounded, args, too_long or ArgumentTooLong)
                if control:
                    self.authorize(dbus_context, name)
                return fn(self, *args, dbus_context=dbus_context) if takes_context else fn(self, *args)
            except SupervisorError as e:
                raise on_the_wire(e) from None

        setattr(checked, _ATTR, (in_signature, out_signature, control))
        return checked

    return mark


_STRING_TYPES = ("s", "o", "g")


def check_arguments(method: str, bounded: list[tuple[int, str, str]], args: tuple[Any, ...],
                    error: type[SupervisorError] = ArgumentTooLong) -> None:
    """Refuse an oversize argument in time independent of its size: len() of a str is stored,
    and only a string already short in characters is encoded to count its bytes."""
    for i, pname, t in bounded:
        if i >= len(args):
            continue
        value = args[i]
        if t in _STRING_TYPES:
            _check_string(method, pname, value, error)
        elif isinstance(value, (list, tuple, dict)):
            if len(value) > MAX_ARRAY_ITEMS:
                raise error(f"{method}: argument {pname!r} has {len(value)} items; the limit is {MAX_ARRAY_ITEMS}")
            items = value.items() if isinstance(value, dict) else ((v,) for v in value)
            for item in items:
                for v in item:
                    if isinstance(v, str):
                        _check_string(method, pname, v, error)


def _check_string(method: str, pname: str, value: Any, error: type[SupervisorError]) -> None:
    if not isinstance(value, str):
        return
    n = len(value)
    if n > MAX_STRING_BYTES:
        raise error(f"{method}: argument {pname!r} is {n} characters long; the limit is "
                              f"{MAX_STRING_BYTES} bytes")
    if n * 4 > MAX_STRING_BYTES:  # UTF-8: at most 4 bytes a character
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_STRING_BYTES:
            raise error(f"{method}: argument {pname!r} is {size} bytes long; the limit is "
                                  f"{MAX_STRING_BYTES} bytes")


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
